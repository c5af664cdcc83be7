"""How a model is spread over ranks: the rank layout of data, pipeline and tensor parallelism
(`layout`), the process group and the few collectives the loop needs (`process_group`), ZeRO-3's
partitioned build (`zero3_init`) and the export's gather of full weights from model-parallel ranks
(`consolidate`)."""
