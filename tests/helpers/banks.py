"""The bank cache tests share, as a program shares one: embedders are loaded once per test run, not per call."""

from packstore.bank.bank import BankCache

TEST_BANK_CACHE = BankCache()

# A fact and a question that describes it without naming a word of it, among facts that share none of its meaning:
# what routing by meaning (and the cross-encoder) must find.
DESCRIBED_FACT = "The lighthouse keeper of Port Elm feeds three gulls every dawn."
DESCRIBED_QUESTION = "Who looks after the birds at the harbour light?"
OTHER_FACTS = [
    "Marble quarries near Vesk supply the cathedral builders.",
    "The ferry to Harl Island leaves at noon on weekdays.",
    "Glassblowers in Otterby use sand from the northern dunes.",
    "The observatory on Mount Quell opened in 1911.",
]
