"""The public path of the vLLM rollout engines, kept for ``python -m fastcov.trainer.rollout_vllm serve MODEL
[vllm serve options]`` and ``from fastcov.trainer.rollout_vllm import make_vllm_engine``. The code lives in
``fastcov.trainer.rollout.vllm_*`` (split by concern: vllm_api.py, vllm_wire.py, vllm_colocated.py,
vllm_server.py, vllm_plugin.py, vllm_factory.py); import other names from there.
"""

import sys

from fastcov.trainer.rollout.vllm_factory import make_vllm_engine
from fastcov.trainer.rollout.vllm_server import main

__all__ = ["main", "make_vllm_engine"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
