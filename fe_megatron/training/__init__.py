"""Engine-neutral training: the loop both engines run, the run interface, the training config
(`fe_megatron.training.config.TrainConfig`), the learning-rate schedule and the runtime helpers
(launcher environment, fault injection, third-party warning filters).

Nothing here imports megatron or deepspeed; the engines (`fe_megatron.megatron.engine`,
`fe_megatron.deepspeed.engine`) build on it.
"""
