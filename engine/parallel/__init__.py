"""How a model is spread over ranks: the rank layout of data, pipeline and tensor parallelism
(`layout`), ZeRO-3's partitioned build (`zero3_init`) and the export's gather of full weights from
model-parallel ranks (`consolidate`)."""
