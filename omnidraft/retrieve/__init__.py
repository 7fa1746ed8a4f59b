"""Retrieval drafts: proposals copied from the request's context and the user's past outputs, in
the target's own ids (ReSpec, SAM-Decoding). See retriever.py for the policy."""

from .automaton import Matcher, SuffixAutomaton
from .datastore import DATASTORE_CAP, Datastore
from .index import DRAFT_SOURCES, Candidate, ContextIndex, RetrievalConfig, RetrievalStats

__all__ = [
    "DATASTORE_CAP",
    "DRAFT_SOURCES",
    "Candidate",
    "ContextIndex",
    "Datastore",
    "Matcher",
    "RetrievalConfig",
    "RetrievalStats",
    "SuffixAutomaton",
]
