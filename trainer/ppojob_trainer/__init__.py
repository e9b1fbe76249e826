"""ppojob data plane: the PPO trainer on Ray. Importing this package never imports torch or ray."""
