"""Where the tables' rows live and how they move and learn (plain PyTorch, no framework).

* `plan`: `TablePlan`, how a run keeps its tables and who trains them, decided once;
* `storage`: the rows' formats (fp32, bf16, fp8 with per-row scales for serving);
* `store`: `TableStore`, a table outside the module's parameters (device or host memory), its
  dense gradient or its row gradients, and `StoreLookup`;
* `row_exchange`: tables sharded by rows, looked up by all-to-all, one layer (`row_lookup`) or a
  whole pipeline stage at a time (`StageRowExchange`);
* `lookahead`: the host tier's lookups started one microbatch ahead;
* `layout`: `TableLayout`, where a rank's rows and columns sit in the whole table;
* `optimizer` (`TableAdamW`, every row) and `sparse_update` (the row-wise and lazy rules, the touched
  rows only), one entry each in `update_rules`;
* `stage_tables` (`StageTables`: the one owner of a pipeline stage's tables in stores, their rows,
  gradients, optimizer state and checkpoint layout; it reduces, norms, clips and updates them for an
  engine).

The memory branches (`fe_megatron.memory`) read their rows through this package; it imports
nothing from them.
"""
