"""The data room: prompts in verl-style parquet or JSON lines (``loading``) and the demo's synthetic
arithmetic task with its offline tokenizer (``synthetic``). Imports nothing else from the trainer."""
