"""Integrations of lorafarm with training libraries (each imported only when used):
`lorafarm.integrations.transformers.LorafarmCallback` for `transformers.Trainer` and TRL's trainers."""
