"""The rank side of spanwarm. Imports no daemon code; torch is imported only when used."""

from spanwarm.client.client import Client, Progress, Ticket
from spanwarm.client.rank_spans import KeyMap, TensorSpans, rank_spans

__all__ = ["Client", "KeyMap", "Progress", "TensorSpans", "Ticket", "rank_spans"]
