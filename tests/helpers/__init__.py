"""What the tests share, in one place: paths, the small configurations, fe-pretrain and torchrun
launches and their metrics, the test cluster, reference implementations and tiny models.

Test modules import from here (or take a fixture from a conftest.py); no test module imports
another."""
