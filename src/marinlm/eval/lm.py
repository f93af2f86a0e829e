"""Log-likelihood scoring, the way lm-evaluation-harness defines it, batched.

- `loglikelihood(context, continuation)`: sum of log p(continuation tokens | context) and whether
  every continuation token is the greedy (argmax) choice. Tokenisation follows the harness: trailing
  spaces of the context move to the continuation, the pair is encoded whole and the continuation is
  the tokens past the context's own encoding. Over-long inputs keep the continuation and the end of
  the context. A BOS token starts every context (the model was trained that way).
- `loglikelihood_rolling(text)`: the log-likelihood of a whole text, in disjoint windows of at most
  `max_length` predicted tokens (the harness's rolling windows).
- `generate_until(context, until, max_tokens)`: greedy continuation cut at the first stop string.

Batching: requests are grouped by context and sorted longest first. A batch computes each shared
context once (prefill with the KV cache), then scores all of that context's continuations from the
cached state; multiple-choice tasks share one context across their choices. In eval mode the MoE is
dropless, so a request's score does not depend on what it is batched with.

With `progress=True` each call shows a bar (requests or windows scored, rate, ETA) on stderr.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from marinlm.model import MarinForCausalLM, SamplingConfig, stream_generate
from marinlm.tokenizer import MarinTokenizer
from marinlm.utils.progress import progress_bar


@dataclass(frozen=True)
class Request:
    context: str
    continuation: str


class Scorer:
    def __init__(
        self,
        model: MarinForCausalLM,
        tokenizer: MarinTokenizer,
        max_length: int | None = None,
        batch_size: int = 32,
        share_context: bool = True,
        progress: bool = False,
    ):
        self.model, self.tok = model.eval(), tokenizer
        self.max_length = max_length or model.config.max_seq_len
        self.batch_size, self.share_context = batch_size, share_context
        self.progress = progress
        self.device = next(model.parameters()).device

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        cont = whole[len(ctx) :]
        if not cont:  # the continuation merged into the context's last token: score it on its own
            ctx, cont = ctx, self.tok.encode(continuation)
        ctx = [self.tok.bos_id, *ctx]
        keep = self.max_length - len(cont)
        if keep < 1:
            raise ValueError(f"continuation of {len(cont)} tokens does not fit max_length {self.max_length}")
        return ctx[-keep:], cont

    @torch.no_grad()
    def loglikelihood(self, requests: list[Request], desc: str = "loglikelihood") -> list[tuple[float, bool]]:
        encoded = [self.encode_pair(r.context, r.continuation) for r in requests]
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (ctx, _) in enumerate(encoded):
            groups[tuple(ctx) if self.share_context else (i, *ctx)].append(i)
        order = sorted(groups, key=lambda k: -(len(k) + max(len(encoded[i][1]) for i in groups[k])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        batch: list[tuple[int, ...]] = []
        rows = 0
        with progress_bar(total=len(requests), desc=desc, unit="req", disable=not self.progress) as bar:
            for key in order:
                if batch and rows + len(groups[key]) > self.batch_size:
                    self._score_batch(batch, groups, encoded, results)
                    bar.update(rows)
                    batch, rows = [], 0
                batch.append(key)
                rows += len(groups[key])
            if batch:
                self._score_batch(batch, groups, encoded, results)
                bar.update(rows)
        return results  # type: ignore[return-value]

    def _score_batch(self, keys, groups, encoded, results) -> None:
        contexts = [encoded[groups[k][0]][0] for k in keys]
        G, Lc = len(contexts), max(map(len, contexts))
        ids = torch.full((G, Lc), self.tok.pad_id, dtype=torch.long)
        real = torch.zeros((G, Lc), dtype=torch.long)
        for g, ctx in enumerate(contexts):  # left-pad: every context ends at the last column
            ids[g, Lc - len(ctx) :] = torch.tensor(ctx)
            real[g, Lc - len(ctx) :] = 1
        positions = torch.where(real.bool(), real.cumsum(1) - 1, torch.arange(Lc))
        caches = self.model.empty_caches(G)
        out = self.model(
            ids.to(self.device), caches=caches, doc_ids=real.to(self.device), positions=positions.to(self.device)
        )
        last_logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # predicts each first token
        members = [(g, i) for g, k in enumerate(keys) for i in groups[k]]
        rows = torch.tensor([g for g, _ in members], device=self.device)
        conts = [encoded[i][1] for _, i in members]
        R, Lt = len(members), max(map(len, conts))
        cont_ids = torch.full((R, Lt), self.tok.pad_id, dtype=torch.long)
        for r, cont in enumerate(conts):
            cont_ids[r, : len(cont)] = torch.tensor(cont)
        logp_rows = [last_logp[rows]]
        if Lt > 1:  # tokens after the first are predicted from the continuation itself
            row_caches = [c.select(rows) for c in caches]
            start = torch.tensor([len(contexts[g]) for g, _ in members]).unsqueeze(1)
            pos = (start + torch.arange(Lt - 1)).to(self.device)
            out = self.model(
                cont_ids[:, :-1].to(self.device), caches=row_caches, doc_ids=torch.ones_like(pos), positions=pos
            )
            logp_rows.append(torch.log_softmax(out.logits.float(), dim=-1))
        logp = torch.cat([logp_rows[0].unsqueeze(1), *logp_rows[1:]], dim=1) if Lt > 1 else logp_rows[0].unsqueeze(1)
        for r, (_, i) in enumerate(members):
            n = len(conts[r])
            target = torch.tensor(conts[r], device=self.device)
            token_logp = logp[r, :n].gather(-1, target.unsqueeze(-1)).squeeze(-1)
            greedy = bool((logp[r, :n].argmax(-1) == target).all())
            results[i] = (float(token_logp.sum()), greedy)

    @torch.no_grad()
    def loglikelihood_rolling(self, texts: list[str], desc: str = "rolling") -> list[tuple[float, int]]:
        """(total log-likelihood, number of predicted tokens) per text."""
        L = self.max_length
        per_text = []
        for text in texts:
            ids = self.tok.encode(text)
            stream = [self.tok.bos_id, *ids]
            windows = []
            for start in range(0, len(ids), L):
                end = min(len(ids), start + L)
                inp = stream[max(0, end - L) : end]  # inputs; the last (end - start) predict ids[start:end]
                windows.append((inp, ids[start:end]))
            per_text.append((ids, windows))
        total_windows = sum(len(windows) for _, windows in per_text)
        bar = progress_bar(total=total_windows, desc=desc, unit="window", disable=not self.progress)
        out = []
        with bar:
            for ids, windows in per_text:
                total = 0.0
                for b in range(0, len(windows), self.batch_size):
                    chunk = windows[b : b + self.batch_size]
                    width = max(len(inp) for inp, _ in chunk)
                    batch = torch.full((len(chunk), width), self.tok.pad_id, dtype=torch.long)
                    for r, (inp, _) in enumerate(chunk):
                        batch[r, : len(inp)] = torch.tensor(inp)
                    logp = torch.log_softmax(self.model(batch.to(self.device)).logits.float(), dim=-1)
                    for r, (inp, targets) in enumerate(chunk):
                        n = len(targets)
                        rows = logp[r, len(inp) - n : len(inp)]
                        total += float(rows.gather(-1, torch.tensor(targets, device=self.device).unsqueeze(-1)).sum())
                    bar.update(len(chunk))
                out.append((total, len(ids)))
        return out

    @torch.no_grad()
    def generate_until(self, context: str, until: list[str], max_tokens: int = 64) -> str:
        ids = torch.tensor([[self.tok.bos_id, *self.tok.encode(context)][-self.max_length :]], device=self.device)
        generated: list[int] = []
        for token in stream_generate(
            self.model, ids, SamplingConfig(max_new_tokens=max_tokens, temperature=0), eos_token_id=self.tok.eos_id
        ):
            if int(token[0]) == self.tok.eos_id:
                break
            generated.append(int(token[0]))
            text = self.tok.decode(generated)
            cut = min((text.find(s) for s in until if s in text), default=-1)
            if cut >= 0:
                return text[:cut]
        return self.tok.decode(generated)


def perplexity(total_loglikelihood: float, count: int) -> float:
    return math.exp(-total_loglikelihood / max(count, 1))
