"""The step-log schema: what every engine records about each scheduling step.

The replay engine writes it (`EngineConfig(record_steps=True)`), a serving engine's monitor writes
the same columns, and the `cost-model` component trains on them, so the simulator can be
calibrated against a real engine.
"""

STEP_FIELDS: tuple[str, ...] = (
    "tokens",  # tokens computed this step (prefill chunks + decodes)
    "sampled",  # requests that produced a token
    "prefill_attn_units",  # sum of c * p + c * (c + 1) / 2 over prefill chunks of c after p cached
    "prefill_kv_read",  # sum of p over prefill chunks
    "num_decodes",
    "decode_ctx_sum",  # cached context summed over decodes
    "decode_ctx_max",
)
STEP_LOG_COLUMNS: tuple[str, ...] = (*STEP_FIELDS, "duration_s")
