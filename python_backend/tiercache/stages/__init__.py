"""The composition root: one factory per Triton stage, from its typed config
(`tiercache.config.STAGE_CONFIGS`). Nothing else builds the stages' parts; each
`model_repository/<stage>/1/model.py` only decodes its inputs (`tiercache.triton.io`), calls its
stage from here and encodes the outputs. docs/architecture.md draws the whole house."""
