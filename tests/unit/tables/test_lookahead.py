"""`fe_megatron.tables.lookahead`: each microbatch's rows are fetched once the previous forward is issued."""

import torch

from fe_megatron.tables.lookahead import (HOST_POSITION_IDS, HOST_TOKENS, MEMORY_INPUTS, MicrobatchLookups,
                                          microbatch_feed)


def test_each_microbatch_s_rows_are_fetched_once_the_previous_forward_is_issued():
    events = []
    batches = [{HOST_TOKENS: torch.full((1, 4), index), HOST_POSITION_IDS: torch.arange(4)[None]}
               for index in range(3)]

    def start(tokens, positions):
        assert positions.tolist() == [[0, 1, 2, 3]]  # with their position ids: a document's n-grams stay in it
        events.append(f"fetch {int(tokens[0, 0])}")
        return {"rows of": int(tokens[0, 0])}

    feed = MicrobatchLookups(batches, start)
    for batch in feed:
        events.append(f"forward {batch[MEMORY_INPUTS]['rows of']}")
        feed.start_next()
    assert events == ["fetch 0", "forward 0", "fetch 1", "forward 1", "fetch 2", "forward 2"]
    assert feed.started == 3


def test_the_engines_feed_starts_lookups_only_for_batches_with_host_tokens():
    """`microbatch_feed`, the one feed both engines walk a step with: batches without host tokens pass
    through as they are (``start_next`` does nothing), batches with them get their lookups one ahead."""
    started = []
    plain = [{"tokens": torch.randint(0, 9, (1, 4))} for _ in range(2)]
    feed = microbatch_feed(plain, lambda tokens, positions: started.append(tokens) or {})
    handed = []
    for batch in feed:
        handed.append(batch)
        feed.start_next()
    assert handed == plain and started == [] and feed.started == 0
    hosted = [{HOST_TOKENS: torch.full((1, 4), index)} for index in range(2)]
    feed = microbatch_feed(hosted, lambda tokens, positions: {"rows of": int(tokens[0, 0])})
    assert [batch[MEMORY_INPUTS]["rows of"] for batch in feed] == [0, 1]
    assert list(microbatch_feed([], lambda tokens, positions: {})) == []
