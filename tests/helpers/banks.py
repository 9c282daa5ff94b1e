"""The bank cache tests share, as a program shares one: embedders are loaded once per test run, not per call."""

from packstore.bank.bank import BankCache

TEST_BANK_CACHE = BankCache()
