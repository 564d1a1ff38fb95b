"""GPU memory per pipeline stage, estimated from the model's shape before any weight loads, and
the ``train.recompute: auto`` rule that reads it.

Per stage: the model state (bf16 weights, fp32 gradient buffer, fp32 master + Adam moments shared
over the data-parallel ranks by ZeRO-1), the activations each decoder layer keeps for backward
(bytes per token by recompute mode, below) times the micro-batches in flight on that stage
(1F1B: stage s holds up to ``stages - s``), one layer's recomputed activations and gradients as
working space, the loss' logits when they are materialised, and a fixed allowance for the CUDA
context, kernels' workspaces and allocator slack.

Kept per token and layer (bf16 elements; h hidden, a = heads x head_dim, kv = KV width, I MLP):

- none:      input, normed input, q, k, v, attention output, o_proj input   = h + h + a + 2 kv + 2 a
             + post-attention input, its norm, gate, up, gate*up             + 2 h + 3 I
- attention: the layer input (the attention half is recomputed) + the MLP half
- mlp:       the attention half + the MLP half's input
- full:      the layer input
- every_n:   full on every n-th layer, none on the others

Calibrated on an H200 (bench/RESULTS.md, issue 29 rows, 16-layer slice of Mistral-7B, seq 16384
and 32768): the counts above match the allocator's peak for ``none`` (36.0 GiB kept vs 36.0
counted); recomputing modes also hold the layer being recomputed and its gradients, so the working
space is 3 layers' worth there (2 without recomputation). With these constants every measured peak
(reserved) lies 1-15 GiB under its estimate. The rule then picks, among the modes that fit, the one
with the fewest recomputed FLOPs (``recompute_flops``); the same rows measured that order as the
speed order (16k: none 68.5% MFU > attention 62.0 > every_n 2 60.3 > mlp 58.8 > full 53.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from training.flops import ModelShape

GIB = 1 << 30
BF16 = 2
# the allocator's peak over the element count above, measured on an H200 (bench/RESULTS.md)
ACTIVATION_SLACK = 1.0
WORKSPACE_LAYERS = {False: 2, True: 3}  # one layer's activations x this: without / with recomputation
FIXED_BYTES = 4 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
USABLE_FRACTION = 0.93  # of the device's memory: fragmentation headroom
EVERY_N_CHOICES = (8, 6, 4, 3, 2)


@dataclass(frozen=True)
class TrainShape:
    """What the estimate needs from the config (one place, so the trainer and the bench agree)."""

    seq_len: int
    micro_batch: int
    stages: int
    dp: int
    micro_batches: int  # per optimizer step (gradient accumulation)
    bf16: bool = True
    grad_accum_fp32: bool = True
    fused_grad_accumulation: bool = True
    fused_loss: bool = True  # liger's fused linear + cross-entropy: no [tokens, vocab] logits
    sliding_window: int | None = None


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    model_state: int
    activations: int
    workspace: int
    logits: int
    fixed: int = FIXED_BYTES

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.workspace + self.logits + self.fixed

    def describe(self) -> str:
        g = GIB
        return (f"stage {self.stage} ({self.layers} layers): {self.total / g:.1f} GiB = model state "
                f"{self.model_state / g:.1f} + activations {self.activations / g:.1f} + working space "
                f"{self.workspace / g:.1f} + logits {self.logits / g:.1f} + fixed {self.fixed / g:.1f}")


def layer_elements(shape: ModelShape, mode: str) -> int:
    """bf16 elements one decoder layer keeps per token for backward (see the module docstring)."""
    h, a, kv, inter = shape.hidden_size, shape.attention_width, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    attention_half = 2 * h + 3 * a + 2 * kv
    mlp_half = 2 * h + 3 * inter
    return {"none": attention_half + mlp_half, "attention": h + mlp_half, "mlp": attention_half + h, "full": h}[mode]


def layer_modes(mode: str, every: int, layers: int) -> list[str]:
    from training.model import layer_recompute

    return [layer_recompute(mode, i, every) for i in range(layers)]


def recompute_flops(shape: ModelShape, mode: str, every: int, seq_len: int, window: int | None = None) -> float:
    """Forward FLOPs per token recomputed in backward, per decoder layer on average."""
    h, a, kv, inter = shape.hidden_size, shape.attention_width, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    keys = min(seq_len / 2, window) if window else seq_len / 2  # mean keys a query attends (causal)
    attention = 2 * (2 * h * a + 2 * h * kv) + 4 * keys * a
    mlp = 2 * 3 * h * inter
    full = attention + mlp
    if mode == "every_n":
        return full / every
    return {"none": 0.0, "attention": attention, "mlp": mlp, "full": full}[mode]


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Decoder layers per stage under partition ``type:DecoderLayerPipe`` (DeepSpeed's balanced split)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def estimate_stages(shape: ModelShape, ts: TrainShape, mode: str, every: int = 2) -> list[StageMemory]:
    h, vocab = shape.hidden_size, shape.vocab_size
    per_layer_params = (2 * h * shape.attention_width + 2 * h * shape.num_kv_heads * shape.head_dim
                        + 3 * h * shape.intermediate_size + 2 * h)
    if ts.bf16:
        # bf16 weight + gradient buffer (fp32, or bf16) + the bf16 grad while it is being added
        # (freed at once with fused accumulation) + fp32 master and Adam moments (ZeRO-1: / dp)
        per_param = 2 + (4 if ts.grad_accum_fp32 else 2) + (0 if ts.fused_grad_accumulation else 2) + 12 / ts.dp
    else:
        per_param = 4 + 4 + 8 / ts.dp
    tokens = ts.seq_len * ts.micro_batch
    out, first = [], 0
    for stage, n in enumerate(stage_layers(shape.num_layers, ts.stages)):
        params = n * per_layer_params
        if stage == 0:
            params += vocab * h
        last = stage == ts.stages - 1
        if last:
            params += h + (0 if shape.tie_embeddings else vocab * h)
        in_flight = min(ts.stages - stage, ts.micro_batches)
        modes = layer_modes(mode, every, shape.num_layers)[first:first + n]
        kept = sum(layer_elements(shape, m) for m in modes) * tokens * BF16 * ACTIVATION_SLACK
        # backward of one layer: its activations (recomputed, or kept) and as many gradients
        factor = WORKSPACE_LAYERS[any(m != "none" for m in modes)]
        workspace = factor * layer_elements(shape, "none") * tokens * BF16 * ACTIVATION_SLACK
        # materialised logits: bf16 + the fp32 copy cross-entropy upcasts + its gradient
        logits = tokens * vocab * (BF16 + 4 + 4) if last and not ts.fused_loss else 0
        out.append(StageMemory(stage, n, int(params * per_param), int(kept * in_flight), int(workspace), logits))
        first += n
    return out


def candidates(num_layers: int) -> list[tuple[str, int]]:
    every = [("every_n", n) for n in EVERY_N_CHOICES if n < num_layers]
    return [("none", 1), *every, ("attention", 1), ("mlp", 1), ("full", 1)]


def choose_recompute(shape: ModelShape, ts: TrainShape, device_bytes: int) -> tuple[str, int, StageMemory] | None:
    """``train.recompute: auto``: the mode with the fewest recomputed FLOPs whose fullest stage fits
    ``USABLE_FRACTION`` of the device; None when not even ``full`` fits."""
    budget = device_bytes * USABLE_FRACTION
    fitting = []
    for mode, every in candidates(shape.num_layers):
        worst = max(estimate_stages(shape, ts, mode, every), key=lambda m: m.total)
        if worst.total <= budget:
            fitting.append((recompute_flops(shape, mode, every, ts.seq_len, ts.sliding_window), mode, every, worst))
    if not fitting:
        return None
    _, mode, every, worst = min(fitting, key=lambda f: (f[0], f[3].total))  # a tie: the smaller estimate
    return mode, every, worst


def fits(stage: StageMemory, device_bytes: int) -> bool:
    return stage.total <= device_bytes * USABLE_FRACTION


def tokens_that_fit(shape: ModelShape, ts: TrainShape, device_bytes: int) -> int:
    """Longest seq_len (multiple of 1024) that fits with full recomputation: for the error message."""
    lo = 0
    for seq in range(1024, 1 << 20, 1024):
        probe = TrainShape(**{**ts.__dict__, "seq_len": seq})
        if max(s.total for s in estimate_stages(shape, probe, "full")) > device_bytes * USABLE_FRACTION:
            break
        lo = seq
    return lo
