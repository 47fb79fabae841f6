"""vidpipe's pipeline runtime: config, sources, stage graph, publishing, metrics, API and CLI."""

__version__ = "0.1.0"
