"""The vLLM rollout engine without vLLM: import/version errors, output conversion, request splitting and
the server-mode weight-update protocol, all against fakes (vLLM cannot be installed here)."""

import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from fastcov.trainer import rollout_vllm as rv
from fastcov.trainer.rollout import SamplingParams, batch_slices, finish_rollouts, split_evenly
from fastcov.trainer.weight_sync import ALIGN, iter_buckets, unflatten

ROOT = Path(__file__).resolve().parent.parent


def _fake_vllm(monkeypatch, version):
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def test_factory_names_missing_vllm(monkeypatch):
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import make_rollout_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    tok = NS(eos_token_id=2, pad_token_id=0)
    with pytest.raises(ImportError, match=r"rollout.engine=vllm needs vLLM>=0\.8\.5,<0\.12.*fastcov\[vllm\]"):
        make_rollout_engine(cfg, model=None, tokenizer=tok, device=torch.device("cpu"))
    cfg.rollout.engine = "sglang"
    with pytest.raises(ValueError, match="rollout.engine"):
        make_rollout_engine(cfg, model=None, tokenizer=tok)


@pytest.mark.parametrize("version", ["0.7.3", "0.8.4", "0.12.0", "0.12.0rc1", "1.0.0", "garbage"])
def test_version_out_of_range_is_refused(monkeypatch, version):
    _fake_vllm(monkeypatch, version)
    with pytest.raises(RuntimeError, match=rf"{version}.*vllm>=0\.8\.5,<0\.12"):
        rv.import_vllm()


@pytest.mark.parametrize("version", ["0.8.5", "0.8.5.post1", "0.10.1.dev3+gabc", "0.11.2"])
def test_version_in_range_is_accepted(monkeypatch, version):
    mod = _fake_vllm(monkeypatch, version)
    assert rv.import_vllm() is mod


def test_colocated_factory_refuses_cpu_and_bad_tp(monkeypatch):
    from fastcov.trainer.config import load_config

    _fake_vllm(monkeypatch, "0.10.2")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["rollout.engine=vllm"])
    tok = NS(eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="rollout.vllm_mode: colocated vLLM needs CUDA"):
        rv.make_vllm_engine(cfg, None, tok, device=torch.device("cpu"))
    cfg.rollout.vllm_tensor_parallel_size = 3
    with pytest.raises(ValueError, match="rollout.vllm_tensor_parallel_size: 3 does not divide the 4"):
        rv.make_vllm_engine(cfg, None, tok, device=torch.device("cuda", 0), world=4)


# ----------------------------------------------------------------------------------------- conversion

def _lp(x):
    return NS(logprob=x, rank=1, decoded_token=None)


def test_request_outputs_to_batch():
    outs = [
        NS(outputs=[NS(token_ids=[5, 6, 2],
                       logprobs=[{5: _lp(-0.1), 9: _lp(-3.0)}, {6: _lp(-0.2)}, {2: _lp(-0.3)}])]),
        NS(outputs=[NS(token_ids=(7, 8), logprobs=[{7: _lp(-1.0)}, {8: _lp(-2.0), 1: _lp(-0.5)}])]),  # cut at max
        NS(outputs=[NS(token_ids=[2, 4], logprobs=[{2: _lp(-0.7)}, {4: _lp(-0.9)}])]),  # eos first: truncated
    ]
    b = rv.request_outputs_to_batch(outs, eos_token_ids=[2])
    assert b.token_ids == [[5, 6, 2], [7, 8], [2]]
    assert b.logprobs == [[-0.1, -0.2, -0.3], [-1.0, -2.0], [-0.7]]
    with pytest.raises(RuntimeError, match="no log-probs for request 0"):
        rv.request_outputs_to_batch([NS(outputs=[NS(token_ids=[1], logprobs=None)])], [2])
    with pytest.raises(RuntimeError, match="lack the sampled token 1"):
        rv.request_outputs_to_batch([NS(outputs=[NS(token_ids=[1], logprobs=[{3: _lp(-1.0)}])])], [2])


def test_completion_response_to_batch_and_payload():
    resp = {"choices": [
        {"index": 1, "logprobs": {"tokens": ["token_id:9", "token_id:2"], "token_logprobs": [-0.5, -0.25]}},
        {"index": 0, "logprobs": {"tokens": ["token_id:4"], "token_logprobs": [-1.5]}},
    ]}
    b = rv.completion_to_batch(resp, 2, [2])
    assert b.token_ids == [[4], [9, 2]] and b.logprobs == [[-1.5], [-0.5, -0.25]]
    with pytest.raises(RuntimeError, match="choices"):
        rv.completion_to_batch(resp, 3, [2])
    bad = {"choices": [{"index": 0, "logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(RuntimeError, match="token_id:N"):
        rv.completion_to_batch(bad, 1, [2])
    p = rv.completion_payload("m", [[1, 2]], SamplingParams(0.7, 0.9, 16), [2])
    assert p["prompt"] == [[1, 2]] and p["logprobs"] == 0 and p["return_tokens_as_token_ids"]
    assert (p["temperature"], p["top_p"], p["max_tokens"], p["stop_token_ids"]) == (0.7, 0.9, 16, [2])
    assert p["top_k"] == -1 and p["repetition_penalty"] == 1.0  # generation_config cannot leak in


def test_shared_request_helpers():
    assert batch_slices(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert batch_slices(3, 0) == [slice(0, 3)] and batch_slices(0, 4) == []
    assert [s.stop - s.start for s in split_evenly(7, 3)] == [3, 2, 2]
    assert [s.stop - s.start for s in split_evenly(1, 3)] == [1, 0, 0]
    assert rv.split_group_requests([2, 0, 1], ["a", "b", "c"]) == [["a", "b"], [], ["c"]]
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

    eng = rv.VLLMServerEngine(["http://a:1/", "http://b:2"], [2], tp=1, device=torch.device("cpu"),
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


# ----------------------------------------------------------------------------------------- weight protocol

class FakeComm:
    def __init__(self):
        self.flats = []

    def broadcast(self, tensor, src):
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.flats.append(tensor.clone())


def test_server_weight_update_protocol_bucket_metadata():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 50, bias=False),
                                torch.nn.Embedding(64, 16))
    model[2].to(torch.bfloat16)
    model.register_buffer("steps", torch.arange(5))
    named = list(model.named_parameters()) + list(model.named_buffers())
    want = {n: t.detach().clone() for n, t in named}
    posts, comms = [], []

    def post(url, payload):
        posts.append((url, payload))
        return {"ok": True}

    def make_comm(host, port, world, device):
        comms.append((host, port, world))
        return FakeComm()

    cap = 6 * 1024
    sender = rv.ServerWeightSender(["http://s0:8000", "http://s1:8000"], tp=2, device=torch.device("cpu"),
                                   post=post, make_communicator=make_comm, host="10.0.0.1")
    eng = rv.VLLMServerEngine(["http://s0:8000", "http://s1:8000"], [2], tp=2, device=torch.device("cpu"),
                              rank=0, post=post, sender=sender)
    buckets = list(iter_buckets(named, cap))
    assert len(buckets) > 2
    eng.update_weights(iter(buckets))

    assert comms == [("10.0.0.1", comms[0][1], 5)]  # world = rank 0 + 2 servers x tp 2
    inits = sorted((u, p) for u, p in posts if u.endswith("/init"))
    assert [p["rank_offset"] for _, p in inits] == [1, 3] and all(p["world_size"] == 5 for _, p in inits)
    metas = [p for u, p in posts if u.endswith("/bucket")]
    flats = sender.comm.flats
    assert len(flats) == len(buckets) and len(metas) == 2 * len(buckets)  # every bucket to every server
    got = {}
    for k, flat in enumerate(flats):
        m0, m1 = metas[2 * k], metas[2 * k + 1]
        assert m0 == m1 and flat.numel() == m0["nbytes"]
        assert m0["nbytes"] <= cap or len(m0["names"]) == 1
        assert all(o % ALIGN == 0 for o in m0["offsets"])
        for name, t in unflatten(flat, rv.BucketMeta.from_json(m0)):
            assert name not in got, f"{name} sent twice"
            got[name] = t
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    assert metas[0]["dtypes"][0] == "float32" and "bfloat16" in sum((m["dtypes"] for m in metas), [])
    assert sorted(u for u, _ in posts[-2:]) == ["http://s0:8000/fastcov/weight_sync/done",
                                               "http://s1:8000/fastcov/weight_sync/done"]
    eng.update_weights(iter(buckets[:1]))  # the group is set up once
    assert len(comms) == 1
    eng.close()


# ----------------------------------------------------------------------------------------- colocated, fake LLM

class FakeLLM:
    def __init__(self):
        self.events = []
        self.worker = NS(model_runner=NS(model=NS(load_weights=self._load)))
        self.loaded = []

    def _load(self, weights):
        self.loaded += [n for n, _ in weights]

    def wake_up(self, tags=None):
        self.events.append(("wake", tuple(tags or ())))

    def sleep(self, level):
        self.events.append(("sleep", level))

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        self.events.append(("reset",))

    def generate(self, prompts, params, use_tqdm=True):
        self.events.append(("generate", len(prompts)))
        assert all(p.logprobs == 0 and p.detokenize is False for p in params)
        return [NS(outputs=[NS(token_ids=[len(p["prompt_token_ids"]), 2],
                               logprobs=[{len(p["prompt_token_ids"]): _lp(-1.0)}, {2: _lp(-2.0)}])])
                for p in prompts]


def test_colocated_engine_with_fake_llm():
    llm = FakeLLM()
    fake_vllm = NS(SamplingParams=lambda **kw: NS(**kw))
    eng = rv.VLLMColocatedEngine(llm, fake_vllm, [2], torch.device("cpu"))
    model = torch.nn.Linear(4, 3)
    eng.update_weights(iter_buckets(list(model.named_parameters()), 1 << 20))
    assert llm.loaded == ["weight", "bias"] and llm.events == [("reset",)]
    g = torch.Generator().manual_seed(0)
    out = eng.generate([[1, 2, 3], [4]], SamplingParams(1.0, 1.0, 4), g)
    assert out.token_ids == [[3, 2], [1, 2]] and out.logprobs == [[-1.0, -2.0], [-1.0, -2.0]]
    assert llm.events[1:] == [("generate", 2), ("sleep", 1)]
    eng.update_weights([("weight", model.weight)])  # wakes the weights only, before loading
    assert llm.events[3] == ("wake", ("weights",))
    eng.generate([[5]], SamplingParams(1.0, 1.0, 4), g)
    assert llm.events[5] == ("wake", ("kv_cache",)) and llm.events[-1] == ("sleep", 1)
