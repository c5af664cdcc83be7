"""Hugging Face `datasets` builders run on local files, offline and without a shared cache."""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

# `datasets` (and pandas, pyarrow under it) is imported where rows are read: the config's checks import
# this module through the data kinds, and a launch's pre-flight must not pay for it.


def load_local_dataset(builder: str, **kwargs: Any) -> datasets.Dataset | datasets.DatasetDict:
    """Run a packaged builder ("text", "json", "parquet", "imagefolder") on local files.

    Every rank of a job calls this at the same moment. The default shared cache would make
    them race on one lock and one set of arrow files, so each call prepares into its own
    throw-away directory and keeps the result in memory: nothing is shared between processes
    and nothing is left on disk. Re-reading a local corpus is cheap next to training on it.
    """
    import datasets
    import pyarrow

    with tempfile.TemporaryDirectory(prefix="dsengine-data-") as cache_dir:
        try:
            return datasets.load_dataset(builder, cache_dir=cache_dir, keep_in_memory=True, **kwargs)
        except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as error:
            # The builder's own message says only that "an error occurred"; the cause names the problem.
            files = kwargs.get("data_files") or kwargs.get("data_dir")
            files = ", ".join(map(str, files)) if isinstance(files, list) else files
            cause = error.__cause__ or error
            raise ValueError(f"{files} could not be read as {builder} data: {type(cause).__name__}: {cause}") from None
