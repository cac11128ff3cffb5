"""The target model, as every stage meets it: loading it (`load`), reading the two tensors a drafter needs from its
checkpoint (`weights`), and the hooks that capture its hidden states (`capture`). The dump, the trainer and the
eval import these; the indices themselves come from the contract (`eagle3.contract`)."""
