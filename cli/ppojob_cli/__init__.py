"""The `ppojob` command: validate, render and print the CRD (the API and the operator's pure
builders), and run a job locally (the trainer). It is the one package that uses both halves."""
