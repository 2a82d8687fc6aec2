"""The job's dimensions besides the pipeline: data parallel on a mesh (``data_parallel``), tied
weights across stages (``tied``) and the global gradient norm (``grad_norm``)."""
