"""Model parallelism: the rank layout of data, pipeline and tensor parallelism (`layout`) and the
export's gather of full weights from model-parallel ranks (`consolidate`)."""
