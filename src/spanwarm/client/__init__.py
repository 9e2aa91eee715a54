"""The rank side of spanwarm. Imports no daemon code; torch is imported only when used."""

from spanwarm.client.rank_spans import KeyMap, TensorSpans, rank_spans

__all__ = ["KeyMap", "TensorSpans", "rank_spans"]
