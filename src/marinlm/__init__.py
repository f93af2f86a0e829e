"""marinlm: an open, end-to-end stack for Marin-style mixture-of-experts language models."""

from marinlm.utils.cpu_math import warm_up_vml

__version__ = "0.1.0"

# Before any parallel call of torch's math kernels, whichever way marinlm is entered (the CLI,
# torchrun's workers, a script importing the model): otherwise a process's first such call may
# run a low-accuracy kernel on one thread (utils/cpu_math.py). Not in `marinlm.model`, which holds
# the model alone and is pasted into exported remote code.
warm_up_vml()
