"""Helpers the tests share: real local servers, simulated counterparts (named SIMULATED), fixture tools, the command line as a user runs it."""
