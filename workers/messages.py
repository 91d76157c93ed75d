"""The message contract between the producer and the workers: the Celery queue, the task names, and the
headers the ledger's scripts and Flower read. Both sides import these names; nothing else defines them.
"""

from __future__ import annotations

from typing import Final

#: The Celery queue every generate task goes through.
QUEUE_NAME: Final = "tokenfleet"

#: Name of the generate task, as Flower shows it.
GENERATE_TASK: Final = "tokenfleet.generate"

#: Celery stamped header carrying the dataset (``revoke_by_stamped_headers dataset=NAME``).
DATASET_STAMP: Final = "dataset"

#: Message header carrying the sample id, read by the ledger's queue purge (``budget/lua/purge_queue.lua``).
SAMPLE_ID_HEADER: Final = "tf_sample_id"

#: The same for a group task: the list of its samples' ids.
SAMPLE_IDS_HEADER: Final = "tf_sample_ids"

#: Name of the task that runs a group of samples at once (``samples_per_task`` > 1).
GENERATE_GROUP_TASK: Final = "tokenfleet.generate_group"
