"""Drop-in integrations of mxmla into existing model code.

- `dispatch.integrations.transformers`: `patch_deepseek_v3(model, path=...)` / `unpatch_deepseek_v3(model)`
  for HF transformers' DeepSeek-V3 (needs the optional extra `.[hf]`; imported only when asked for, so
  `import dispatch` works without transformers).
- `dispatch.integrations.torchtitan`: `convert_deepseek_v3(model_config, path=...)`, the converter
  `MXMLAConverter` and the override `mxmla_attention` for TorchTitan's DeepSeek-V3 (the extra
  `.[torchtitan]`; imported only when asked for).
Fallbacks and their reasons are logged to `logging.getLogger("mxmla.integrations")`.
"""
