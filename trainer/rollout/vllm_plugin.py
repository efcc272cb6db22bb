"""``fastcov_gloo``: a vLLM weight-transfer backend for servers without NCCL (vLLM's CPU build, or a GPU
machine where NCCL is not available), loaded by vLLM itself through its ``vllm.general_plugins`` entry point
(pyproject: ``fastcov = "fastcov.trainer.rollout.vllm_plugin:register"``) in every process of a server.

Same protocol as vLLM's ``nccl`` backend (``/init_weight_transfer_engine`` once, then per sync
``/start_weight_update``, per bucket ``/update_weights`` with names, dtypes and shapes while trainer rank 0
broadcasts the flat bucket, ``/finish_weight_update``), but the broadcast goes over a gloo group of its own
(a ``TCPStore`` at the trainer's address plus ``ProcessGroupGloo``: no default process group is touched on
either side) and the flat bucket lives in host memory. The layout is ``vllm_wire.pack_flat``'s (the tensors'
bytes back to back); each worker loads the received views with its model's ``load_weights`` inside vLLM's
layerwise reload, like the ``nccl`` and ``fastcov_local`` backends. On a GPU server the copy to the device
happens in ``load_weights``.
"""

from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass, field

import torch

from fastcov.trainer.rollout.vllm_api import GLOO_BACKEND
from fastcov.trainer.rollout.vllm_wire import FlatChunk

TIMEOUT = datetime.timedelta(minutes=30)


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other end of a gloo pair connects to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: no packet is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class GlooCommunicator:
    """A gloo group of ``world_size`` ranks of its own: rank 0 (the trainer) hosts the rendezvous store at
    ``host:port``. ``broadcast(tensor, src, stream)`` has the signature of vLLM's ``PyNcclCommunicator``'s,
    so the trainer's sender drives either; tensors must be in host memory."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        import torch.distributed as dist

        self.rank, self.world_size = int(rank), int(world_size)
        self.store = dist.TCPStore(host, int(port), self.world_size, self.rank == 0, timeout=TIMEOUT)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
        opts._timeout = TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, int(port)))]
        self.group = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        import torch.distributed as dist

        if tensor.device.type != "cpu":
            raise ValueError(f"fastcov_gloo: broadcast needs a host tensor, got one on {tensor.device}")
        opts = dist.BroadcastOptions()
        opts.rootRank = int(src)
        self.group.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]  # bound by torch's C++, no stub


@dataclass
class GlooInitInfo:
    """``init_info`` of ``fastcov_gloo``: the trainer's rendezvous and this server's first rank."""

    master_address: str = "127.0.0.1"
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 2


@dataclass
class GlooUpdateInfo:
    """``update_info`` of ``fastcov_gloo``: one flat bucket's tensors, in order."""

    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)


def receive_chunk(comm, info: GlooUpdateInfo) -> list[tuple[str, torch.Tensor]]:
    """Receive one flat bucket from rank 0 and cut it into (name, tensor) views."""
    sizes = [math.prod(s) * getattr(torch, d).itemsize for d, s in zip(info.dtype_names, info.shapes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    comm.broadcast(flat, src=0)
    return FlatChunk(flat, list(info.names), list(info.dtype_names), [list(s) for s in info.shapes], sizes).views()


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """After vLLM's layerwise reload: run ``process_weights_after_loading`` again on every layer whose weight
    another layer shares (a tied LM head). The reload processes only the layer whose loader received the
    tensor (the embedding; the checkpoint has no ``lm_head.weight`` when tied), so a layer that keeps a
    processed form of the weight (vLLM's CPU build prepacks it for its GEMM) would keep computing with the
    old one. vLLM's first load processes every layer, so this is what it did then. Returns the layers
    processed."""
    by_weight: dict[int, list] = {}
    for mod in model.modules():
        w, method = getattr(mod, "weight", None), getattr(mod, "quant_method", None)
        if isinstance(w, torch.Tensor) and not w.is_meta and method is not None:
            by_weight.setdefault(w.data_ptr(), []).append(mod)
    n = 0
    for mods in by_weight.values():
        if len(mods) > 1:
            for mod in mods:
                mod.quant_method.process_weights_after_loading(mod)
                n += 1
    return n


_GLOO_ENGINE_CLS = None


def gloo_transfer_engine_cls() -> type:
    """The ``fastcov_gloo`` backend: a subclass of vLLM's ``WeightTransferEngine`` (built on first use)."""
    global _GLOO_ENGINE_CLS
    if _GLOO_ENGINE_CLS is not None:
        return _GLOO_ENGINE_CLS
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class FastcovGlooWeightTransferEngine(WeightTransferEngine):
        """Receives flat buckets over gloo and loads them inside vLLM's layerwise reload."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        comm = None

        def init_transfer_engine(self, init_info) -> None:
            rank = init_info.rank_offset + int(getattr(self.parallel_config, "rank", 0))
            self.comm = GlooCommunicator(init_info.master_address, init_info.master_port, rank,
                                         init_info.world_size)

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_tied_layers(self.model)

        def receive_weights(self, update_info) -> None:
            if self.comm is None:
                raise RuntimeError("fastcov_gloo: /update_weights before /init_weight_transfer_engine")
            self.model.load_weights(receive_chunk(self.comm, update_info))

        def shutdown(self) -> None:
            self.comm = None

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:  # abstract in vLLM 0.26; unused here
            raise NotImplementedError("fastcov_gloo: the trainer sends with vllm_server.ServerWeightSender")

    _GLOO_ENGINE_CLS = FastcovGlooWeightTransferEngine
    return _GLOO_ENGINE_CLS


def register() -> None:
    """vLLM's plugin hook (``vllm.general_plugins``): register ``fastcov_gloo`` once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, gloo_transfer_engine_cls())
    except ValueError:  # already registered in this process (vLLM may load plugins more than once)
        pass
