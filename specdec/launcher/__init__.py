"""The launcher, on top of everything: the `specdec` CLI and the local stack of real processes.
It names the services by module and starts them; nothing below it imports it."""
