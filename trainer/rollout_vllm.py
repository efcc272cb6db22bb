"""The public path of the vLLM rollout engines, kept for ``python -m fastcov.trainer.rollout_vllm serve MODEL
[vllm serve options]`` and ``from fastcov.trainer.rollout_vllm import make_vllm_engine``. The code lives in
``fastcov.trainer.rollout.vllm_*`` (split by concern: vllm_api.py, vllm_wire.py, vllm_colocated.py,
vllm_server.py, vllm_plugin.py, vllm_factory.py); nothing in fastcov imports this module.
"""

import sys

from fastcov.trainer.rollout.vllm_api import (  # noqa: F401
    GLOO_BACKEND,
    LOCAL_BACKEND,
    LOGPROBS_MODE,
    ROUTES,
    SERVER_BACKEND,
    SUPPORTED,
    TESTED_VERSIONS,
    VLLMApi,
    check_vllm_version,
    import_vllm,
    release_tuple,
)
from fastcov.trainer.rollout.vllm_colocated import (  # noqa: F401
    LocalInitInfo,
    LocalUpdateInfo,
    VLLMColocatedEngine,
    local_transfer_engine_cls,
    register_local_backend,
)
from fastcov.trainer.rollout.vllm_factory import colocated_llm_kwargs, make_vllm_engine, rollout_dtype  # noqa: F401
from fastcov.trainer.rollout.vllm_server import (  # noqa: F401
    ServerWeightSender,
    VLLMServerEngine,
    main,
    post_json,
    routable_ip,
    serve,
    serve_command,
    transfer_backend,
)
from fastcov.trainer.rollout.vllm_wire import (  # noqa: F401
    FlatChunk,
    chunk_runs,
    completion_payload,
    completion_to_batch,
    derived_buffer_names,
    iter_chunks,
    pack_flat,
    request_outputs_to_batch,
    sampling_kwargs,
    split_group_requests,
    wire_dtype,
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
