"""Evaluation: perplexity / bits per byte and downstream tasks scored as lm-evaluation-harness does."""
