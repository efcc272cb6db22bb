"""The token-level room: advantages per token rather than per response. ``advantages`` turns a batch
into token advantages for REINFORCE++ (KL penalty in the reward) and PRIME; ``prime`` holds PRIME's
implicit process reward model, trained online, and the frozen reference it is measured against."""
