"""Hugging Face `datasets` builders run on local files, offline and without a shared cache."""

import tempfile
from typing import Any

import datasets


def load_local_dataset(builder: str, **kwargs: Any) -> datasets.Dataset | datasets.DatasetDict:
    """Run a packaged builder ("text", "json", "parquet", "imagefolder") on local files.

    Every rank of a job calls this at the same moment. The default shared cache would make
    them race on one lock and one set of arrow files, so each call prepares into its own
    throw-away directory and keeps the result in memory: nothing is shared between processes
    and nothing is left on disk. Re-reading a local corpus is cheap next to training on it.
    """
    with tempfile.TemporaryDirectory(prefix="dsengine-data-") as cache_dir:
        return datasets.load_dataset(builder, cache_dir=cache_dir, keep_in_memory=True, **kwargs)
