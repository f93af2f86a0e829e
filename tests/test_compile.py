"""The GPU step's shape, checked on a CPU: every block type compiles whole (`fullgraph=True`),
FlexAttention's forward equals the reference, and no forward, backward, optimizer step or QB update
reads a value back from the device. (The 20-step compiled run is in test_train.py.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marinlm.config import load_config
from marinlm.kernels import apply_kernels
from marinlm.kernels.flex_attention import FlexAttention
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.model.attention import Attention
from marinlm.model.config import AttentionConfig
from marinlm.model.moe import MoE
from marinlm.optim import MarinOptimizerConfig, build_optimizer
from test_kernels import context, segments

from conftest import CONFIGS, randomize_identity_inits

# The hero's shape (every kind of layer, capacity pooled over groups and domains, GQA with global
# layers on half the KV heads) at a width a CPU traces in seconds; one dense layer first, so that
# the dense block type is there too.
HERO_SIZED_DOWN = [
    "--vocab_size=512",
    "--d_model=96",
    "--num_layers=4",
    "--gated_norm_rank=8",
    "--attention.num_heads=8",
    "--attention.head_dim=16",
    "--attention.num_kv_heads=4",
    "--attention.num_global_kv_heads=2",
    "--attention.sliding_window=24",
    "--moe.num_experts=16",
    "--moe.first_k_dense=1",
    "--moe.dense_ffn_dim=64",
    "--moe.expert_dim=32",
    "--moe.latent_dim=32",
    "--moe.shared_expert_dim=32",
    "--moe.capacity_groups=4",
    "--moe.capacity_domains=2",
    "--moe.router.hist_bins=100",
]


def model_of(name: str, precision: str) -> MarinForCausalLM:
    if name == "hero":
        config = load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml", HERO_SIZED_DOWN)
    else:
        config = load_config(MarinConfig, CONFIGS / "model" / f"{name}.yaml")
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    apply_kernels(model, "cpu", precision)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    randomize_identity_inits(model)
    return model


def block_types(model: MarinForCausalLM) -> dict[tuple[bool, bool], torch.nn.Module]:
    """The first block of each kind: (global attention, MoE)."""
    kinds: dict[tuple[bool, bool], torch.nn.Module] = {}
    for block in model.layers:
        kinds.setdefault((block.is_global, isinstance(block.mlp, MoE)), block)
    return kinds


@pytest.mark.parametrize(
    "name, precision, packed",
    [("tiny", "fp32", True), ("tiny", "bf16", False), ("hero", "bf16", True), ("hero", "fp32", False)],
)
def test_every_block_type_compiles_whole(name, precision, packed):
    """torch.compile(block, fullgraph=True) raises at the first graph break. Each block type
    (attention with its masks, SConv, GatedNorm, the router with its QB histogram, dispatch,
    grouped experts and combine) is traced as one graph forward and backward (AOTAutograd; inductor
    compiles the same graphs in test_train.py's compiled run), and gives eager's output and
    gradients."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    model = model_of(name, precision)
    kinds = block_types(model)
    expected = {(False, True), (True, True)} | ({(False, False)} if name == "hero" else set())
    assert set(kinds) == expected
    B, T = 2, 64
    seg = segments(B, T) if packed else None
    x = torch.randn(B, T, model.config.d_model, generator=torch.Generator().manual_seed(0))
    for kind, block in kinds.items():
        torch._dynamo.reset()
        counters.clear()
        backend = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        results = []
        for run in (block, compiled):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                y, routing = run(xi, context(seg, B, T, model.config.attention.sliding_window))
            loss = y.float().square().mean() + (routing.aux_loss if routing and routing.aux_loss is not None else 0)
            loss.backward()
            results.append([y.float(), xi.grad, *(p.grad.clone() for p in block.parameters())])
            block.zero_grad()
        assert backend.frame_count == 1 and not counters["graph_break"], (kind, dict(counters["graph_break"]))
        # bf16: compiled blocks take grouped_mm experts and plain fp32 products where eager takes
        # chunked bf16 GEMMs (kernels/experts.py, kernels/bf16.py), so a few bf16 steps apart.
        tolerance = 1e-5 if precision == "fp32" else 3e-2
        for i, (a, b) in enumerate(zip(*results, strict=True)):
            scale = a.abs().max().clamp_min(1e-6)
            error = ((b - a).abs().max() / scale).item()
            assert error <= tolerance, f"{name} {kind}: tensor {i} off by {error:.2e} of its largest value"


@pytest.mark.parametrize("name", ["hero"])  # every block kind; `tiny` trains so, compiled, in test_train.py
def test_checkpointed_blocks_compile_whole(name):
    """Full activation checkpointing under compile (`parallelize`'s order: checkpoint, then compile
    each wrapped block whole): the first block writes the forward's rope tables and masks into the
    context inside its checkpoint, the later ones read them; the model's loss and every gradient
    equal eager checkpointing's, with no graph break."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing
    from marinlm.parallel.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    eager = model_of(name, "fp32")
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        apply_activation_checkpointing(model, "full")
    ids = torch.randint(0, eager.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):  # as a fresh process
        apply_compile(compiled, fullgraph=True, backend="aot_eager")
        for model in (eager, compiled):
            out = model(ids, segments(2, 64), labels=ids, return_logits=False)
            out.loss.backward()
            results.append([out.loss.detach(), *(p.grad for p in model.parameters())])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        scale = a.abs().max().clamp_min(1e-6)
        assert ((b - a).abs().max() / scale).item() <= 1e-5, f"{name}: tensor {i}"


def test_flex_attention_forward_equals_the_reference():
    """FlexAttention's forward (compiled: torch runs it on CPU only so) against the reference
    attention in fp32 and bf16: global layers, windows shorter (6) and longer (24) than most packed
    documents and shorter than a one-document row, 200 tokens (the block mask's last tile is
    partial)."""
    import torch._dynamo

    torch._dynamo.reset()
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=24, qk_norm=True, xsa=True, head_gate=True
    )
    B, T = 2, 200
    a = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(1))
    packed, one_document = segments(B, T, seed=3), None
    # Each case is a graph of its own for inductor to build (slow with a cold cache): few cases.
    cases = [("fp32", None, one_document), ("fp32", 6, packed), ("fp32", 24, packed), ("bf16", 24, one_document)]
    for precision, window, seg in cases:
        cfg = dataclasses.replace(config, sliding_window=window or config.sliding_window)
        torch.manual_seed(0)
        attn = Attention(cfg, 64, is_global=window is None, sconv_sites=["k", "v"], sconv_kernel=4, init_std=0.1)
        attn.reset_parameters()
        with torch.no_grad():
            attn.gate.weight.normal_(0, 0.3)
            for conv in (attn.sconv_k, attn.sconv_v):
                conv.weight.normal_(0, 0.5)
        flex = copy.deepcopy(attn)
        flex.__class__ = FlexAttention
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            reference = attn(a, context(seg, B, T, cfg.sliding_window)).float()
            out = torch.compile(flex, fullgraph=True)(a, context(seg, B, T, cfg.sliding_window)).float()
        scale = reference.abs().max()
        tolerance = 1e-5 if precision == "fp32" else 3e-2
        case = f"{precision}, window {window}, {'packed' if seg is not None else 'one document'}"
        torch.testing.assert_close(out / scale, reference / scale, rtol=0, atol=tolerance, msg=case)


def test_flex_attention_is_taken_for_compiled_blocks_on_gpus_only():
    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml")

    def attention_classes(device, compiled, precision="bf16"):
        with torch.device("meta"):
            model = apply_kernels(MarinForCausalLM(config), device, precision, compiled=compiled)
        return {type(m).__name__ for m in model.modules() if isinstance(m, Attention)}

    assert attention_classes("cuda", compiled=True) == {"FlexAttention"}
    assert attention_classes("cuda", compiled=False) == {"FusedAttention"}
    assert attention_classes("cuda", compiled=True, precision="fp64") == {"FusedAttention"}
    assert attention_classes("cpu", compiled=True) == {"FusedAttention"}  # no CPU backward in torch 2.13


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (.item(), int(), .tolist()) and tensors built
    from host values (`torch.tensor(x, device=cuda)` is a copy the host waits for)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["tiny", "qwen3-moe-style"])
def test_a_training_step_never_waits_for_the_device(name):
    """The GPU path (`grouped_mm` experts, the routers, the fused loss, MuonH and Adam) reads no
    value back to the host in the forward, the backward, the optimizer step or the QB bias update,
    twice over (the first step creates the optimizer's state): a wait there leaves the GPU idle
    while the host queues the next kernels, and a CUDA graph cannot hold it."""
    model = model_of(name, "fp32")
    optimizer = build_optimizer(model, MarinOptimizerConfig(), "cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    seg = segments(2, 64)
    for _ in range(2):
        phases = {}
        with HostReads() as mode:
            out = model(ids, seg, labels=ids, return_logits=False)
        phases["forward"] = mode.reads
        with HostReads() as mode:
            out.loss.backward()
        phases["backward"] = mode.reads
        with HostReads() as mode:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phases["optimizer"] = mode.reads
        with HostReads() as mode:
            model.update_router_biases([s.detach() for s in out.router_stats])
        phases["qb update"] = mode.reads
        assert phases == dict.fromkeys(phases, 0)
    assert int(out.num_tokens) == ids.numel()


def test_fp8_converts_the_dense_projections_and_keeps_every_key():
    """`train.fp8`: torchao's Float8Linear in the attention, latent and shared-expert projections;
    the router, head gate, GatedNorm, LM head and routed experts as they were; the same keys."""
    pytest.importorskip("torchao.float8")
    from marinlm.config import ConfigError
    from marinlm.kernels.fp8 import apply_fp8

    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml")
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    keys = set(model.state_dict())
    assert apply_fp8(model, torch.device("cpu"), "bf16") == 4 * 12  # 4 layers, 2 shared experts
    converted = {name.split(".", 2)[-1] for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    shared = {f"mlp.shared.{i}.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    assert (
        converted
        == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.latent_down", "mlp.latent_up"} | shared
    )
    assert set(model.state_dict()) == keys
    with pytest.raises(ConfigError, match="train.fp8"):
        apply_fp8(model, torch.device("cpu"), "fp64")


def test_an_fp8_step_tracks_bf16():
    """One layer of `tiny`, one forward and backward under bf16 autocast, with and without FP8
    projections (torch runs FP8 GEMMs in software on a CPU): the loss within 2%, every gradient
    pointing the same way (cosine > 0.95: FP8's rounding, e4m3 forward and e5m2 backward)."""
    pytest.importorskip("torchao.float8")
    from marinlm.kernels.fp8 import apply_fp8

    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml", ["--num_layers=1"])
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for fp8 in (False, True):
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        if fp8:
            apply_fp8(model, torch.device("cpu"), "bf16")
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        results.append(
            (loss.item(), {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None})
        )
    (bf16, grads), (fp8, fp8_grads) = results
    assert fp8 == pytest.approx(bf16, rel=0.02)
    assert grads.keys() == fp8_grads.keys()
    for name, g in grads.items():
        assert torch.nn.functional.cosine_similarity(g, fp8_grads[name], dim=0) > 0.95, name
