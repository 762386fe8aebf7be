"""fe-pretrain's entry (`fe_megatron.train`) without training: the kernel backend it accepts for the tables'
device. The arguments it asks for, overrides between the options and --check, as a user runs the command,
are tests/integration/test_commands.py's."""

import pytest
import torch


def test_forced_kernel_backend_must_take_the_tables_device():
    from fe_megatron.train import check_kernel_backend

    check_kernel_backend("cpp", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kernel backend 'cpp' runs on cpu tensors, but this run's tables are on "
                                         r"cuda; use kernel_backend=auto or one of \['torch'"):
        check_kernel_backend("cpp", torch.device("cuda"))
