"""vLLM rollout engines (``rollout.engine: vllm``): the supported versions, the import, and the one version
adapter.

Supported vLLM: ``>=0.26,<0.34`` (the ``vllm`` extra of pyproject). ``vllm`` is imported only when an engine
is built; a missing one raises ImportError, one outside the range RuntimeError, both naming the installed
version and the range. Every vLLM name the ``vllm_*`` modules use is checked against the source of vLLM
0.26.0 and 0.33.0 by tests/trainer/rollout/test_vllm_api.py (``make test-vllm-api``); where the two differ,
``VLLMApi`` says which form to use. The modules by concern: vllm_wire.py (flat buckets, request bodies, output
conversion), vllm_colocated.py (in-process engine and its ``fastcov_local`` transfer backend), vllm_server.py (HTTP
engine, weight senders, the ``serve`` command), vllm_plugin.py (the ``fastcov_gloo`` backend a server loads),
vllm_factory.py (``make_vllm_engine``). docs/vllm.md has setup, modes and memory.
"""

from __future__ import annotations

import re
from types import ModuleType

from fastcov.errors import MissingPackage

SUPPORTED = ">=0.26,<0.34"
_MIN, _BELOW = (0, 26), (0, 34)
TESTED_VERSIONS = ("0.26.0", "0.33.0")  # the sources tests/trainer/rollout/test_vllm_api.py parses
LOGPROBS_MODE = "raw_logprobs"
LOCAL_BACKEND = "fastcov_local"  # the in-process weight-transfer backend registered by register_local_backend
SERVER_BACKEND = "nccl"  # what a CUDA server with NCCL uses
GLOO_BACKEND = "fastcov_gloo"  # without NCCL (CPU, or a GPU build without it): vllm_plugin.py
# vLLM's weight-update routes (served with VLLM_SERVER_DEV_MODE=1), in the order of one sync
ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
          "/reset_prefix_cache")


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.26.1.post1"`` -> (0, 26, 1); ``"0.34.0rc1"`` -> (0, 34, 0) (pre-releases count as their release)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        raise RuntimeError(f"vLLM: cannot parse the installed version {version!r}; fastcov supports "
                           f"vllm{SUPPORTED} (0.26 to 0.33)")
    return tuple(int(x) for x in m.group(1).split("."))


def check_vllm_version(version: str) -> tuple[int, ...]:
    rel = release_tuple(version)
    if not (_MIN <= rel[:2] < _BELOW):
        raise RuntimeError(f"rollout.engine=vllm: vLLM {version} is installed, fastcov supports vllm{SUPPORTED} "
                           f"(0.26 to 0.33; pip install 'fastcov[vllm]')")
    return rel


def import_vllm() -> ModuleType:
    """The ``vllm`` module, checked against the supported range."""
    try:
        import vllm
    except ImportError as exc:  # a user error (one line, exit 2), still an ImportError for callers that catch it
        raise MissingPackage(f"rollout.engine=vllm needs vLLM{SUPPORTED} (0.26 to 0.33), which is not installed "
                             f"or does not import (pip install 'fastcov[vllm]'): {exc}") from exc
    check_vllm_version(getattr(vllm, "__version__", "unknown"))  # start-up checked the installed one already
    return vllm


class VLLMApi:
    """The one place where supported vLLM versions differ for this module.

    NCCL packed transfer: up to 0.27 the packed flag and buffer geometry travel with every
    ``update_weights`` (``NCCLWeightTransferUpdateInfo``); from 0.28 they are fixed once by
    ``init_weight_transfer_engine`` (``NCCLWeightTransferInitInfo``) and the update info carries only
    names, dtypes and shapes. Everything else this module calls is the same in 0.26 and 0.33.
    """

    PACKED_AT_INIT_FROM = (0, 28)
    NUM_BUFFERS = 1  # one receive buffer: a chunk is one bucket, loaded before the next arrives

    def __init__(self, version: str):
        self.version = str(version)
        self.release = release_tuple(version)

    @property
    def packed_at_init(self) -> bool:
        return self.release[:2] >= self.PACKED_AT_INIT_FROM

    def _packed(self, buffer_bytes: int) -> dict:
        return {"packed": True, "packed_buffer_size_bytes": int(buffer_bytes),
                "packed_num_buffers": self.NUM_BUFFERS}

    def nccl_init_info(self, *, host: str, port: int, world_size: int, rank_offset: int,
                       buffer_bytes: int) -> dict:
        """``init_info`` of ``/init_weight_transfer_engine`` for one server's workers."""
        info = {"master_address": host, "master_port": int(port), "rank_offset": int(rank_offset),
                "world_size": int(world_size)}
        if self.packed_at_init:
            info.update(self._packed(buffer_bytes))
        return info

    def nccl_update_info(self, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                         buffer_bytes: int) -> dict:
        """``update_info`` of ``/update_weights`` for one bucket."""
        info = {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes]}
        if not self.packed_at_init:
            info.update(self._packed(buffer_bytes))
        return info
