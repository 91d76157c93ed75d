"""The Celery side: the app (``workers.app:app``), the generate task, the SGLang client, the output sink."""
