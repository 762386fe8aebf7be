"""`fe_megatron.training.run`: validation reads the same samples in the same microbatches at every
data-parallel size."""

from fe_megatron.training.config import load_train_config
from tests.helpers.training import CONFIG


def test_validation_reads_the_same_samples_in_the_same_microbatches_at_every_data_parallel_size(monkeypatch):
    import torch

    from fe_megatron.training import run as run_module
    from fe_megatron.training.run import EngineRun

    monkeypatch.setattr(run_module, "current_device", lambda: torch.device("cpu"))

    class Samples:  # sample i holds the token i
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            return {"tokens": [i], "labels": [i], "loss_mask": [1.0], "position_ids": [0]}

    cfg = load_train_config(CONFIG, ["training.global_batch_size=8", "training.micro_batch_size=2",
                                     "training.eval_steps=3"])

    def microbatches_read(dp):
        read = []
        for rank in range(dp):
            run = EngineRun(cfg=cfg, info={}, datasets=(), num_microbatches=8 // (2 * dp), metrics=None, start_step=0,
                            parameters=0)
            run.data_parallel_rank = lambda rank=rank: rank
            read += [tuple(batch["tokens"].flatten().tolist()) for batch in run.evaluation_batches(Samples(), 1)]
        return sorted(read)

    expected = [(i, i + 1) for i in range(24, 48, 2)]  # window 1: global batches 3, 4 and 5
    assert microbatches_read(1) == microbatches_read(2) == microbatches_read(4) == expected
