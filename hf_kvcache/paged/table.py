"""`PageTable`: which pool page holds each full page of each batch row.

`ids [batch, pages]` (int32): row `b`'s tokens `p * page_size : (p + 1) * page_size` are in pool page `ids[b, p]`.
Every row of a batch has seen the same number of positions (left padding included), so all rows have the same number
of full pages and the table is a dense tensor. The table only names pages; the reference counts it implies are kept
by the pool (`PagedLayer` retains the new entries and releases the old ones whenever the table changes).
"""

from __future__ import annotations

import torch


class PageTable:
    def __init__(self, batch: int = 0, device: torch.device | str = "cpu") -> None:
        self.ids = torch.zeros(batch, 0, dtype=torch.int32, device=device)

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def pages(self) -> int:
        return self.ids.shape[1]

    def append(self, new: torch.Tensor) -> None:
        """Add pages `new [batch, n]` after the last full page of every row."""
        if new.shape[0] != self.batch:
            raise ValueError(f"new pages are for {new.shape[0]} rows, the table has {self.batch}")
        self.ids = torch.cat([self.ids, new.to(self.ids)], 1)

    def take_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows [new_batch]` of the table (repeats allowed), as a new table tensor; the old one is returned."""
        old = self.ids
        self.ids = old.index_select(0, rows.to(old.device))
        return old

    def drop_last(self, n: int) -> torch.Tensor:
        """Remove the last `n` pages of every row; returns them `[batch, n]`."""
        if not 0 <= n <= self.pages:
            raise ValueError(f"cannot drop {n} pages of {self.pages}")
        dropped = self.ids[:, self.pages - n :]
        self.ids = self.ids[:, : self.pages - n].clone()
        return dropped

    def long(self) -> torch.Tensor:
        return self.ids.long()

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids]
