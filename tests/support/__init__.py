"""Helpers the tests share: plain functions and classes, no fixtures (those live in the conftest files).

``env`` where the tests find Redis, ``files`` configs and JSONL, ``fleet`` the simulator, submit and
worker processes, ``ledger`` the ledger script tests' helpers, ``tokenizer`` the one tokenizer the tests
build, ``exports`` what export reads from a ledger, stubbed.
"""
