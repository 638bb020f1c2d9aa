"""Front door: `megaheal run`, the healer embedded with a launcher, healing one job it started itself."""
