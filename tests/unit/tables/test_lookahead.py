"""`fe_megatron.tables.lookahead`: each microbatch's rows are fetched once the previous forward is issued."""

import torch

from fe_megatron.tables.lookahead import HOST_TOKENS, MEMORY_LOOKUPS, MicrobatchLookups


def test_each_microbatch_s_rows_are_fetched_once_the_previous_forward_is_issued():
    events = []
    batches = [{HOST_TOKENS: torch.full((1, 4), index)} for index in range(3)]

    def start(tokens):
        events.append(f"fetch {int(tokens[0, 0])}")
        return {"rows of": int(tokens[0, 0])}

    feed = MicrobatchLookups(batches, start)
    for batch in feed:
        events.append(f"forward {batch[MEMORY_LOOKUPS]['rows of']}")
        feed.start_next()
    assert events == ["fetch 0", "forward 0", "fetch 1", "forward 1", "fetch 2", "forward 2"]
    assert feed.started == 3
