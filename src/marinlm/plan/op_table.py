"""The per-operation cost table that prices a step (plan/ops.py), measured on this machine.

`MeasuredTable` times each priced operation the first time the plan asks for it, at its exact
shape, with the threads this process has (torchrun gives each rank one): a GEMM by (M, K, N) and
dtype; attention's core, the routed experts and the LM head with loss as the model's own modules
(with the run's kernels) run them, forward and backward, and the forward alone (a checkpointed
block runs it again); a block's memory-bound work as one block of its kind runs it, forward and backward (on a CPU);
other memory-bound work by an elementwise add of the same bytes (in cache or not); an operation's dispatch on the
host by a chain of small operations recorded for autograd, forward and backward.
Each time is the best of a few repeats after a warm-up: the machine's speed, not its load.

The table is for the hardware it runs on (`marinlm plan --hardware cpu`); a GPU's would be written
by `bench/gpu_check.py` on that GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from marinlm.kernels.config import KernelConfig
from marinlm.model.config import MarinConfig
from marinlm.plan.activations import layer_kind, packed_segments

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A step's operations read what others wrote long before, and write where others wrote: timed
# operations cycle over copies of their operands this large in all, not one copy kept in cache.
COLD_BYTES = 2**26
# Routings the experts run before they are timed, as a run's first steps (`MeasuredTable.experts`).
WARM_ROUTINGS = 8


def best_seconds(fn, min_seconds: float = 0.02, repeats: int = 3, device: str = "cpu") -> float:
    """Best time of `fn()` over at least `repeats` runs and `min_seconds`, after one warm-up."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or spent < min_seconds:
        start = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
        if runs >= 50:
            break
    return best


@dataclass
class MeasuredTable:
    """Costs measured here for `model` in `precision` with `kernels` (see the module docstring)."""

    model: MarinConfig
    precision: str
    kernels: KernelConfig = field(default_factory=KernelConfig)
    experts_local: int = 0  # routed experts on a rank (expert parallel); 0: all
    device: str = "cpu"
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        if self.device == "cuda":
            return f"measured here ({torch.cuda.get_device_name()})"
        return f"measured here ({torch.get_num_threads()} thread(s))"

    def _memo(self, key, measure):
        if key not in self._cache:
            torch.manual_seed(0)
            with torch.device(self.device):
                self._cache[key] = measure()
        return self._cache[key]

    def entries(self) -> list[dict]:
        """Every cost measured so far: the operation and its shape, and the seconds."""
        return [
            {"op": [str(part) for part in key] if isinstance(key, tuple) else key, "seconds": value}
            for key, value in self._cache.items()
        ]

    def _best(self, fn) -> float:
        return best_seconds(fn, device=self.device)

    @staticmethod
    def _cold(inputs: tuple) -> tuple[itertools.cycle, collections.deque]:
        """Copies of `inputs` (leaves requiring grad stay leaves) enough to fill `COLD_BYTES` (at
        most 256), cycled, so that each timed call reads operands out of cache; and a queue as long
        that holds the calls' outputs, as a step holds them."""
        nbytes = sum(t.nbytes for t in inputs if isinstance(t, torch.Tensor))
        copies = min(max(1, COLD_BYTES // max(nbytes, 1)), 256)

        def copy(t):
            if not isinstance(t, torch.Tensor):
                return t
            return t.detach().clone().requires_grad_(t.requires_grad)

        sets = [inputs] + [tuple(copy(t) for t in inputs) for _ in range(copies - 1)]
        return itertools.cycle(sets), collections.deque(maxlen=copies)

    def gemm(self, m: int, k: int, n: int, dtype: str | None = None, batch: int = 1) -> float:
        """Seconds of one [m, k] x [k, n] product (`batch` of them in one batched call) in `dtype`
        (default: the run's compute dtype)."""
        dt = DTYPES[dtype or self.precision]

        def measure():
            a, b = torch.randn(batch, m, k, dtype=dt), torch.randn(batch, k, n, dtype=dt)
            if batch == 1:
                a, b = a[0], b[0]
            return self._best(lambda: a @ b)

        return self._memo(("gemm", batch, m, k, n, dt), measure)

    def linear(self, tokens: int, fan_in: int, fan_out: int) -> tuple[float, float]:
        """(forward, forward + backward) seconds of a linear layer's GEMMs on `tokens` rows, with
        the operands laid out as autograd has them (the weight [out, in], its transpose in the
        forward, the output gradient's in the weight gradient), in the compute dtype."""
        dt = DTYPES[self.precision]

        def measure():
            x = torch.randn(tokens, fan_in, dtype=dt, requires_grad=True)
            w = torch.randn(fan_out, fan_in, dtype=dt, requires_grad=True)
            dy = torch.randn(tokens, fan_out, dtype=dt)
            operands, outputs = self._cold((x, w, dy))

            def both():
                x, w, dy = next(operands)
                x.grad = w.grad = None  # a step's gradients are new tensors, not sums into old ones
                torch.nn.functional.linear(x, w).backward(dy)

            forward = self._best(lambda: outputs.append(torch.nn.functional.linear(*next(operands)[:2])))
            return forward, self._best(both)

        return self._memo(("linear", tokens, fan_in, fan_out, dt), measure)

    def _timed(self, run, inputs) -> tuple[float, float]:
        """(forward, forward + backward) of `run(*inputs)` under the run's autocast, on cold copies
        of `inputs` (`_cold`)."""
        autocast = torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.precision == "bf16")
        operands, outputs = self._cold(tuple(inputs))

        def forward(these=None):
            with autocast:
                out = run(*(these or next(operands)))
            if these is None:
                outputs.append(out)
            return out

        def both():
            these = next(operands)
            for t in these:
                if isinstance(t, torch.Tensor):
                    t.grad = None
            out = forward(these)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        return self._best(forward), self._best(both)

    def _model(self, layer: int):
        """The model cut after block `layer` (one more where a last layer is global: `layer` keeps its kind)."""
        from marinlm.kernels import apply_kernels
        from marinlm.model.transformer import MarinForCausalLM

        layers = min(layer + 2, self.model.num_layers)
        config = dataclasses.replace(self.model, num_layers=layers, vocab_size=8, tie_embeddings=False)
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        apply_kernels(model, self.device, self.precision, self.kernels)
        model.to_empty(device=self.device)
        model.init_weights(seed=0)
        return model

    def attention(self, rows: int, seq_len: int, is_global: bool) -> tuple[float, float]:
        """(forward, forward + backward) of a layer's attention core on `rows` rows of packed documents."""

        def measure():
            c = self.model
            layer = next(i for i in range(c.num_layers) if c.is_global_layer(i) == is_global)
            model = self._model(layer)
            attn = model.layers[layer].attn
            a = c.attention
            kv = a.global_kv_heads() if is_global else a.num_kv_heads
            dt = torch.bfloat16 if self.precision == "bf16" else torch.float32
            q = torch.randn(rows, a.num_heads, seq_len, a.head_dim, dtype=dt, requires_grad=True)
            k = torch.randn(rows, kv, seq_len, a.head_dim, dtype=dt, requires_grad=True)
            v = torch.randn(rows, kv, seq_len, a.head_dim, dtype=dt, requires_grad=True)
            ids = torch.zeros(rows, seq_len, dtype=torch.long)
            ctx = model.context(ids, packed_segments(rows, seq_len).to(self.device), None, None, None)
            return self._timed(lambda q, k, v: attn.attend(q, k, v, ctx, attn.layer_mask(ctx)), (q, k, v))

        return self._memo(("attention", rows, seq_len, is_global), measure)

    def experts(self, tokens: int) -> tuple[float, float]:
        """(forward, forward + backward) of a rank's routed experts on the assignments of `tokens`
        tokens, routed at random, each call anew after `WARM_ROUTINGS` routings: a step's
        per-expert counts are not the last step's, and a GEMM of a shape not seen before can cost
        more (oneDNN builds its bf16 kernels for each new shape; the fused kernel's padded chunks
        take a few shapes, which the warm-up builds, the grouped GEMMs one a count). Under expert
        parallel, the same number of assignments over its `experts_local` experts, run as
        `ExpertParallelExperts` runs what a rank receives (the kernel's `run_experts` on rows
        grouped by expert, after the rows are regrouped)."""

        def measure():
            from marinlm.kernels import apply_kernels
            from marinlm.model.experts import RoutedExperts

            m = self.model.moe
            width = m.latent_dim or self.model.d_model
            local = self.experts_local or m.num_experts
            k = min(m.top_k, local)
            rows = tokens * m.top_k // k
            experts = RoutedExperts(local, width, m.expert_dim, self.model.init_std)
            experts.reset_parameters()
            apply_kernels(experts, self.device, self.precision, self.kernels)
            first = torch.arange(k).expand(rows, k)  # k different experts a row, from a random one on
            weights = torch.full((rows, k), 1.0 / k)
            shared = local < m.num_experts  # expert parallel: a rank holds a share of the experts
            x = torch.randn(rows * k if shared else rows, width, requires_grad=True)

            def routed(x):
                return experts(x, (first + torch.randint(local, (rows, 1))) % local, weights)[0]

            def received(x):  # expert parallel: a rank's received rows, as `ExpertParallelExperts` runs them
                dtype = torch.get_autocast_dtype(self.device) if torch.is_autocast_enabled(self.device) else x.dtype
                order = torch.randperm(rows * k)  # rows arrive by source, regrouped by expert, and back
                counts = torch.bincount(torch.randint(local, (rows * k,)), minlength=local)
                y = experts.run_experts(x.to(dtype)[order], counts, experts.resolve_impl(dtype))
                return y.new_zeros(y.shape).index_copy(0, order, y).view(rows, k, -1).sum(1)

            run = received if shared else routed
            for _ in range(WARM_ROUTINGS):  # a run's first steps: the shapes most routings share are built
                run(x).float().sum().backward()
            return self._timed(run, (x,))

        return self._memo(("experts", tokens), measure)

    def loss(self, tokens: int) -> tuple[float, float]:
        """(forward, forward + backward) of the LM head and loss on `tokens` tokens."""

        def measure():
            from marinlm.kernels import apply_kernels
            from marinlm.model.loss import NextTokenLoss

            c = self.model
            loss = NextTokenLoss(c.z_loss_weight)
            apply_kernels(loss, self.device, self.precision, self.kernels)
            h = torch.randn(tokens, c.d_model, requires_grad=True)
            w = (0.02 * torch.randn(c.vocab_size, c.d_model)).requires_grad_()
            labels = torch.randint(0, c.vocab_size, (tokens,))
            return self._timed(lambda h, w: loss(h, w, labels)[0], (h, w))

        return self._memo(("loss", tokens), measure)

    def block_memory(self, kind: str, rows: int, seq_len: int) -> tuple[float, float]:
        """(forward, backward) seconds of the memory-bound operations of one block of `kind` (plan/
        activations.py `layer_kind`) on `rows` rows: the model's own block run forward and backward
        under the run's autocast, each operation timed as it runs there (norms, SConv, RoPE, gates,
        residuals, autocast's casts: the casts and strided reads that an add of the same bytes does
        not price), the GEMMs, attention's core and the routed experts left out (priced by shape);
        the best of a few runs, each operation's kernel only (its dispatch is priced apart)."""

        def measure():
            from marinlm.plan.ops import _KernelTimer, mark_priced

            c = self.model
            layer = next(i for i in range(c.num_layers) if layer_kind(c, i) == kind)
            model = self._model(layer)
            block = model.layers[layer]
            timer = _KernelTimer()
            mark_priced(timer, block)
            run = timer.region(block.forward, "block")
            ids = torch.zeros(rows, seq_len, dtype=torch.long)
            ctx = model.context(ids, packed_segments(rows, seq_len).to(self.device), None, None, None)
            x = torch.randn(rows, seq_len, c.d_model, requires_grad=True)
            autocast = torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.precision == "bf16")
            times = []
            for _ in range(4):  # the first builds what later calls reuse (the context's tables: once a forward)
                x.grad = None
                block.zero_grad(set_to_none=True)  # a step's gradients are new tensors, not sums into old ones
                timer.seconds.clear()
                with timer:
                    with autocast:
                        out = run(x, ctx)[0]
                    out.float().sum().backward()
                times.append((timer.seconds.get("block/forward", 0.0), timer.seconds.get("block/backward", 0.0)))
            return min(t[0] for t in times[1:]), min(t[1] for t in times[1:])

        return self._memo(("block_memory", kind, rows, seq_len), measure)

    def elementwise(self, nbytes: float) -> float:
        """Seconds of one memory-bound operation moving `nbytes` (an add: two reads, one write),
        measured at the nearest power of two on operands not in cache (a step's operations read
        what others wrote long before: adds cycle over 64 MiB of them), with the threads' start-up."""
        size = 2 ** max(round(math.log2(max(nbytes, 12) / 12)), 0)  # fp32 elements of each tensor

        def measure():
            sets = max(1, 2**24 // (3 * size))
            operands = [(torch.randn(size), torch.randn(size), torch.empty(size)) for _ in range(min(sets, 4096))]

            def cycle():
                for a, b, out in operands:
                    torch.add(a, b, out=out)

            return self._best(cycle) / len(operands) * nbytes / (12 * size)

        return self._memo(("elementwise", size), measure)

    @property
    def dispatch(self) -> tuple[float, float]:
        """(seconds an operation, seconds a view) on the host, in a step recorded for autograd."""

        def measure():
            x = torch.ones(4, requires_grad=True)

            def chain():
                y = x
                for _ in range(200):
                    y = y * 1.0001
                y.sum().backward()

            def views():
                y = x.detach()
                for _ in range(200):
                    y = y.view(2, 2).view(4)

            return self._best(chain) / 400, self._best(views) / 400

        return self._memo("dispatch", measure)


_TABLES: dict[tuple, MeasuredTable] = {}


def measured_table(model: MarinConfig, precision: str, kernels: KernelConfig, experts_local: int = 0) -> MeasuredTable:
    """One `MeasuredTable` a model, precision, kernels and thread count in this process (each
    measurement is made once), measured with the allocator set as the trainer sets it: glibc's
    default returns large blocks to the OS, and its threshold moves with what the process did before."""
    from marinlm.utils.perf import tune_cpu_allocator

    key = (repr(model), precision, repr(kernels), experts_local, torch.get_num_threads())
    if key not in _TABLES:
        tune_cpu_allocator()
        _TABLES[key] = MeasuredTable(model, precision, kernels, experts_local=experts_local)
    return _TABLES[key]
