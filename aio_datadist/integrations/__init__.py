"""Connectors that plug aio_datadist into serving engines.

``aio_datadist.integrations.vllm`` is vLLM's KV connector (``AioDatadistConnector``;
see ``docs/vllm.md``). Importing this package imports no engine: each
integration's module imports its engine when it is imported itself.
"""

__all__: list[str] = []
