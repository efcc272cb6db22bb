import os

import torch

# The Triton kernels run on CPU tensors through the interpreter when there is no GPU. Set before
# triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
