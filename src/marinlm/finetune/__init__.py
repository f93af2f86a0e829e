"""Fine-tuning: SFT on chat data with loss masks, LoRA (experts included), QLoRA, partial unfreezing."""

import logging

# bitsandbytes (imported by peft) tries, on AVX512-BF16 CPUs, to fetch a 4-bit GEMM from the Hub's
# `kernels` package and warns when it cannot; marinlm downloads nothing at run time, and the
# fallback (dequantise + F.linear) is the path it uses.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
