"""Log-likelihood scoring, the way lm-evaluation-harness defines it, batched.

- `loglikelihood(context, continuation)`: sum of log p(continuation tokens | context) and whether
  every continuation token is the greedy (argmax) choice. Tokenisation follows the harness: trailing
  spaces of the context move to the continuation, the pair is encoded whole and the continuation is
  the tokens past the context's own encoding. Over-long inputs keep the continuation and the end of
  the context; a continuation that fills the window by itself is scored in windows, as
  `loglikelihood_rolling` scores a text. A BOS token starts every context (the model was trained that way).
- `loglikelihood_rolling(text)`: the log-likelihood of a whole text, in disjoint windows of at most
  `max_length` predicted tokens (the harness's rolling windows); `leading_windows(text, n)` the start
  of a text that fills about n of them (eval's --limit on a text file).
- `generate_until(context, until, max_tokens)`: greedy continuation cut at the first stop string.

Batching: requests are grouped by context and sorted longest first. A batch computes each shared
context once (prefill with the KV cache), then scores all of that context's continuations from the
cached state; multiple-choice tasks share one context across their choices. In eval mode the MoE is
dropless, so a request's score does not depend on what it is batched with.

Under torchrun (a process group exists) the batches are dealt across ranks and the scores gathered,
so every rank returns all of them. A sharded (FSDP) model needs every rank in each forward: all
ranks run the same number of forwards, a rank out of batches re-scoring one and dropping the result.

With `progress=True` each call shows a bar (requests or windows scored, rate, ETA) on stderr.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from marinlm.model import MarinForCausalLM, SamplingConfig, stream_generate
from marinlm.model.loss import IGNORE_INDEX
from marinlm.parallel.distributed import all_gather_object, rank_and_world
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
        start_id: int | None = None,
    ):
        self.model, self.tok = model.eval(), tokenizer
        # What every scored text starts with: the token training documents began with
        # (marinlm.loading.document_start_id); BOS when not given.
        self.start_id = tokenizer.bos_id if start_id is None else start_id
        self.max_length = max_length or model.config.max_seq_len
        self.batch_size, self.share_context = batch_size, share_context
        self.progress = progress
        self.device = next(model.parameters()).device
        self.rank, self.world = rank_and_world()

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
        ctx = [self.start_id, *ctx]
        # The model reads at most max_length inputs: the context and all but the last continuation
        # token, as the harness's window `(ctx + cont)[-(max_length + 1):][:-1]`.
        keep = self.max_length + 1 - len(cont)
        if keep < 1:  # the continuation alone fills the window: all of the context, for `_score_long`
            return ctx, cont
        return ctx[-keep:], cont

    @torch.no_grad()
    def loglikelihood(self, requests: list[Request], desc: str = "loglikelihood") -> list[tuple[float, bool]]:
        encoded = [self.encode_pair(r.context, r.continuation) for r in requests]
        # A continuation that fills the window by itself (PIQA's longest solutions against a
        # 256-token model) is rare: it is scored on its own, in windows, by every rank, so that every
        # rank runs the same forwards. The others are batched.
        long = {i for i, (ctx, cont) in enumerate(encoded) if len(ctx) + len(cont) > self.max_length + 1}
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (ctx, _) in enumerate(encoded):
            if i not in long:
                groups[tuple(ctx) if self.share_context else (i, *ctx)].append(i)
        order = sorted(groups, key=lambda k: -(len(k) + max(len(encoded[i][1]) for i in groups[k])))
        batches: list[list[tuple[int, ...]]] = []
        rows = 0
        for key in order:
            if not batches or rows + len(groups[key]) > self.batch_size:
                batches.append([])
                rows = 0
            batches[-1].append(key)
            rows += len(groups[key])
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        mine = batches[self.rank :: self.world]
        total = sum(len(groups[k]) for batch in mine for k in batch) + len(long)
        with progress_bar(total=total, desc=desc, unit="req", disable=not self.progress) as bar:
            for i in sorted(long):
                results[i] = self._score_long(*encoded[i])
                bar.update(1)
            for i in range(-(-len(batches) // self.world)):
                if i < len(mine):
                    self._score_batch(mine[i], groups, encoded, results)
                    bar.update(sum(len(groups[k]) for k in mine[i]))
                else:  # the other ranks run one more batch: take part, drop the scores
                    self._score_batch(batches[0], groups, encoded, [None] * len(requests))
        return self._gathered(results)

    def _gathered(self, results: list) -> list:
        """Every rank's scores merged (each rank filled its own slots); as is on one process."""
        if self.world == 1:
            return results
        merged = list(results)
        for part in all_gather_object({i: r for i, r in enumerate(results) if r is not None}):
            for i, r in part.items():
                merged[i] = r
        return merged

    def _score_long(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        """A continuation of more than `max_length` tokens, in windows of at most `max_length` inputs:
        each predicts the next disjoint run of up to `max_length` continuation tokens from as much of
        what precedes it as fits, as `loglikelihood_rolling`'s windows do."""
        L, stream = self.max_length, ctx + cont
        total, greedy = 0.0, True
        for start in range(len(ctx), len(stream), L):
            end = min(len(stream), start + L)
            inputs = torch.tensor([stream[max(0, end - 1 - L) : end - 1]], device=self.device)
            n = end - start  # the last n inputs predict stream[start:end]
            logp_NV = torch.log_softmax(self.model(inputs, logits_to_keep=n).logits[0].float(), dim=-1)
            target_N = torch.tensor(stream[start:end], device=self.device)
            total += float(logp_NV.gather(1, target_N[:, None]).double().sum())
            greedy = greedy and bool((logp_NV.argmax(-1) == target_N).all())
        return total, greedy

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
            ids.to(self.device),
            caches=caches,
            doc_ids=real.to(self.device),
            positions=positions.to(self.device),
            logits_to_keep=1,
        )
        first_logp_GV = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # predicts each first token
        members = [(g, i) for g, k in enumerate(keys) for i in groups[k]]
        rows = torch.tensor([g for g, _ in members], device=self.device)
        conts = [encoded[i][1] for _, i in members]
        R, Lt = len(members), max(map(len, conts))
        cont_ids = torch.full((R, Lt), self.tok.pad_id, dtype=torch.long)
        for r, cont in enumerate(conts):
            cont_ids[r, : len(cont)] = torch.tensor(cont)
        target_RL = cont_ids.to(self.device)
        first_logp_RV = first_logp_GV[rows]
        token_logp = [first_logp_RV.gather(1, target_RL[:, :1])]  # each [R, positions]
        top = [first_logp_RV.argmax(-1, keepdim=True)]
        # Tokens after the first are predicted from the continuation itself. Under torchrun this
        # forward runs even for one-token continuations, so that every rank runs the same forwards.
        if Lt > 1 or self.world > 1:
            width = max(Lt - 1, 1)
            row_caches = [c.select(rows) for c in caches]
            start = torch.tensor([len(contexts[g]) for g, _ in members]).unsqueeze(1)
            pos = (start + torch.arange(width)).to(self.device)
            out = self.model(
                cont_ids[:, :width].to(self.device), caches=row_caches, doc_ids=torch.ones_like(pos), positions=pos
            )
            if Lt > 1:
                logp_RWV = torch.log_softmax(out.logits.float(), dim=-1)
                token_logp.append(logp_RWV.gather(-1, target_RL[:, 1:].unsqueeze(-1)).squeeze(-1))
                top.append(logp_RWV.argmax(-1))
                del logp_RWV
        counted_RL = (
            torch.arange(Lt, device=self.device) < torch.tensor([len(c) for c in conts], device=self.device)[:, None]
        )
        sums = (
            torch.where(counted_RL, torch.cat(token_logp, 1), 0.0).double().sum(1).tolist()
        )  # fp64: no rounding of the total
        greedy = ((torch.cat(top, 1) == target_RL) | ~counted_RL).all(1).tolist()
        for r, (_, i) in enumerate(members):
            results[i] = (sums[r], greedy[r])

    def leading_windows(self, text: str, n: int) -> str:
        """The start of `text` that fills about `n` rolling windows: cut at the last line end before
        the end of its `n * max_length`-th token (at that token when the first line is longer)."""
        budget = n * self.max_length
        size = 8 * budget  # characters: encode a prefix that holds the budget with tokens to spare (a big file)
        while True:
            encoding = self.tok.backend.encode(text[:size], add_special_tokens=False)
            if len(encoding.ids) > budget + 64 or size >= len(text):
                break
            size *= 2
        if len(encoding.ids) <= budget:
            return text
        cut = encoding.offsets[budget - 1][1]  # in characters
        return text[: text.rfind("\n", 0, cut) + 1 or cut]

    @torch.no_grad()
    def loglikelihood_rolling(self, texts: list[str], desc: str = "rolling") -> list[tuple[float, int]]:
        """(total log-likelihood, number of predicted tokens) per text."""
        L = self.max_length
        lengths, windows = [], []  # windows: (text number, inputs, targets), in text order
        for t, text in enumerate(texts):
            ids = self.tok.encode(text)
            stream = [self.start_id, *ids]
            for start in range(0, len(ids), L):
                end = min(len(ids), start + L)
                # inputs; the last (end - start) of them predict ids[start:end]
                windows.append((t, stream[max(0, end - L) : end], ids[start:end]))
            lengths.append(len(ids))
        chunks = [
            list(range(b, min(b + self.batch_size, len(windows)))) for b in range(0, len(windows), self.batch_size)
        ]
        mine = chunks[self.rank :: self.world]
        scores: list[float | None] = [None] * len(windows)
        bar = progress_bar(total=sum(map(len, mine)), desc=desc, unit="window", disable=not self.progress)
        with bar:
            for i in range(-(-len(chunks) // self.world)):
                chunk = mine[i] if i < len(mine) else chunks[0]  # past our share: take part, drop (see loglikelihood)
                width = max(len(windows[w][1]) for w in chunk)
                batch = torch.full((len(chunk), width), self.tok.pad_id, dtype=torch.long)
                labels = torch.full_like(batch, IGNORE_INDEX)  # the last len(targets) inputs predict them
                for r, w in enumerate(chunk):
                    _, inp, targets = windows[w]
                    batch[r, : len(inp)] = torch.tensor(inp)
                    labels[r, len(inp) - len(targets) : len(inp)] = torch.tensor(targets)
                # Through the model's chunked LM head and loss: per-token cross-entropy without the
                # [B, T, V] logits (32 windows of 4,096 tokens, 128k vocabulary: 34 GB in bf16).
                out = self.model(batch.to(self.device), labels=labels.to(self.device), return_logits=False)
                if i >= len(mine):
                    continue
                for w, row_ce in zip(chunk, out.token_ce.double().sum(1).tolist()):
                    scores[w] = -row_ce
                bar.update(len(chunk))
        scores = self._gathered(scores)
        totals = [0.0] * len(texts)
        for (t, _, _), score in zip(windows, scores):
            totals[t] += score
        return list(zip(totals, lengths))

    @torch.no_grad()
    def generate_until(self, context: str, until: list[str], max_tokens: int = 64) -> str:
        ids = torch.tensor([[self.start_id, *self.tok.encode(context)][-self.max_length :]], device=self.device)
        generated: list[int] = []
        for token in stream_generate(
            self.model,
            ids,
            SamplingConfig(max_new_tokens=max_tokens, temperature=0),
            eos_token_id=self.tok.eos_id,
            vocab_size=self.tok.vocab_size,
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
