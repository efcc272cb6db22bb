"""The public path of the code tasks (``fastcov.trainer.code_tasks.write_code_task``); they live in
trainer/rewards/code_task.py."""

from fastcov.trainer.rewards.code_task import (  # noqa: F401
    DATA_SOURCE,
    CodeRewardFn,
    code_row,
    extract_code,
    parse_tests,
    same_output,
    synthetic_code_tasks,
    write_code_task,
)
