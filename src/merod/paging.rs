//! Reading one of merod's offset-paged lists whole, or not at all. Offset paging can lie
//! in three ways: a server that ignores `offset` answers the first page for ever (a loop that
//! ends only on a short page never ends); a row removed before the offset between two page
//! reads shifts the rest, so a row held throughout is skipped and the list looks whole; and a
//! server that serves fewer rows a page than asked (500 where 1,000 were asked) makes its
//! first page look like the last.
//!
//! Pages therefore overlap by one row (the anchor): each page after the first must start with
//! the previous page's last row, must add at least one row, and there are at most so many
//! pages. A page shorter than asked ends the list only where that agrees with merod's
//! documented paging: merod serves at least its default page ([`PAGE_FLOOR`] rows) whenever
//! that many remain, so a page under it is the last. A short page of [`PAGE_FLOOR`] rows or
//! more, before any full page of this walk, may be merod's own cap: the next offset is read
//! to tell (one extra read, only for lists that long and shorter than a page asked). When it brings rows, merod's cap is learned and the walk goes on in
//! pages of that size; when it brings none, the list is whole; when it cannot be read as the
//! continuation, the list is not read whole. Every paged read of merod goes through
//! [`PageWalk`].

/// merod's default page (`limit` unset: 100 rows), which it serves whenever that many rows
/// remain, whatever cap it puts on larger pages: a page shorter than this is the last one.
pub(crate) const PAGE_FLOOR: usize = 100;

/// Why a paged read cannot be taken as whole.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PageFault {
    /// The page started with the first row of the page before: the offset is ignored.
    #[error("the page at offset {offset} repeats the one before (is `offset` ignored?)")]
    NotAdvancing {
        /// The offset asked for.
        offset: usize,
    },
    /// The page did not start with the previous page's last row: rows were added or removed
    /// before it while the list was read.
    #[error("the list changed while it was read (the page at offset {offset} does not start where the one before ended)")]
    Shifted {
        /// The offset asked for.
        offset: usize,
    },
    /// More pages than the bound.
    #[error("more than {max} pages")]
    TooManyPages {
        /// The bound.
        max: usize,
    },
}

/// What to do after a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Read the page at [`PageWalk::offset`] next.
    More,
    /// The list is read whole.
    Done,
}

/// One walk through an offset-paged list, asking `size` rows a page, at most `max_pages`
/// pages (see the module docs).
#[derive(Debug)]
pub(crate) struct PageWalk {
    size: usize,
    max_pages: usize,
    pages: usize,
    offset: usize,
    /// The previous page's first and last row.
    previous: Option<(String, String)>,
    /// The rows a page merod serves at most, once known: a page as long as asked, or a
    /// short page followed by more rows. A page shorter than it is the last.
    cap: Option<usize>,
    /// The page before was short but not surely the last: this one tells.
    confirming: bool,
    /// How many rows the page before held.
    last_len: usize,
}

impl PageWalk {
    /// A walk from offset 0; `size` is at least 2 (a page must hold the anchor and a new row).
    pub(crate) fn new(size: usize, max_pages: usize) -> Self {
        Self {
            size: size.max(2),
            max_pages,
            pages: 0,
            offset: 0,
            previous: None,
            cap: None,
            confirming: false,
            last_len: 0,
        }
    }

    /// The offset of the next page to read, once per page.
    ///
    /// Errors: [`PageFault::TooManyPages`] once `max_pages` pages were read.
    pub(crate) fn next_page(&mut self) -> Result<usize, PageFault> {
        if self.pages >= self.max_pages {
            return Err(PageFault::TooManyPages {
                max: self.max_pages,
            });
        }
        self.pages += 1;
        Ok(self.offset)
    }

    /// The page size to ask for.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Takes the keys of the page just read, in order (its first row, after the first page,
    /// is the anchor: a row the page before gave already).
    ///
    /// Errors: [`PageFault::NotAdvancing`] or [`PageFault::Shifted`] when the list cannot
    /// be taken as whole.
    pub(crate) fn page<'a>(
        &mut self,
        keys: impl IntoIterator<Item = &'a str>,
    ) -> Result<Step, PageFault> {
        let keys: Vec<&str> = keys.into_iter().collect();
        if let Some((first, last)) = &self.previous {
            match keys.first() {
                Some(k) if k == last => {}
                Some(k) if k == first => {
                    return Err(PageFault::NotAdvancing {
                        offset: self.offset,
                    })
                }
                _ => {
                    return Err(PageFault::Shifted {
                        offset: self.offset,
                    })
                }
            }
        }
        let len = keys.len();
        if self.confirming {
            self.confirming = false;
            if len <= 1 {
                // Only the anchor: the short page before was the last.
                return Ok(Step::Done);
            }
            // More rows: the short page before was merod's cap.
            self.cap = Some(self.last_len);
        }
        // A full page: as asked, or as merod's learned cap serves them.
        let full = self.cap.map_or(self.size, |cap| cap.min(self.size));
        if len >= self.size {
            // merod served all that was asked: it puts no cap below it.
            self.cap = Some(self.size);
        }
        if len < full {
            if len < PAGE_FLOOR || self.cap.is_some() {
                return Ok(Step::Done);
            }
            // Short, yet long enough to be merod's cap: the next offset tells.
            self.confirming = true;
        }
        if let (Some(first), Some(last)) = (keys.first(), keys.last()) {
            self.previous = Some(((*first).to_owned(), (*last).to_owned()));
        }
        self.last_len = len;
        self.offset += len - 1;
        Ok(Step::More)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `rows` (as a server would serve them, `serve(offset, limit)`) with a walk.
    fn walk(
        size: usize,
        max: usize,
        mut serve: impl FnMut(usize, usize) -> Vec<String>,
    ) -> Result<Vec<String>, PageFault> {
        let mut w = PageWalk::new(size, max);
        let mut out = Vec::new();
        loop {
            let offset = w.next_page()?;
            let page = serve(offset, w.size());
            let anchor = usize::from(offset > 0);
            out.extend(page.iter().skip(anchor).cloned());
            if w.page(page.iter().map(String::as_str))? == Step::Done {
                return Ok(out);
            }
        }
    }

    fn rows(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{i:04}")).collect()
    }

    #[test]
    fn a_list_is_read_whole_across_overlapping_pages_of_any_length() {
        for n in [0, 1, 2, 9, 10, 11, 19, 20, 27, 100] {
            let all = rows(n);
            let got = walk(10, 100, |o, l| {
                all.iter().skip(o).take(l).cloned().collect()
            });
            assert_eq!(got.unwrap(), all, "{n} rows");
        }
    }

    #[test]
    fn a_server_ignoring_offset_ends_the_read_at_the_second_page() {
        let all = rows(25);
        let mut served = 0;
        let got = walk(10, 1000, |_, l| {
            served += 1;
            all.iter().take(l).cloned().collect()
        });
        assert_eq!(got, Err(PageFault::NotAdvancing { offset: 9 }));
        assert_eq!(served, 2);
    }

    #[test]
    fn a_row_removed_or_added_before_the_offset_between_pages_is_a_shift() {
        for change in ["remove", "add"] {
            let mut all = rows(25);
            let mut pages = 0;
            let got = walk(10, 100, |o, l| {
                pages += 1;
                if pages == 2 {
                    match change {
                        "remove" => drop(all.remove(3)),
                        _ => all.insert(0, "-001".to_owned()),
                    }
                }
                all.iter().skip(o).take(l).cloned().collect()
            });
            assert_eq!(got, Err(PageFault::Shifted { offset: 9 }), "{change}");
        }
        // A row removed after the anchor is read whole as it now is (it is gone).
        let mut all = rows(25);
        let mut pages = 0;
        let got = walk(10, 100, |o, l| {
            pages += 1;
            if pages == 2 {
                all.remove(15);
            }
            all.iter().skip(o).take(l).cloned().collect()
        });
        assert_eq!(got.unwrap().len(), 24);
    }

    #[test]
    fn pages_are_capped() {
        let all = rows(1000);
        let got = walk(10, 5, |o, l| all.iter().skip(o).take(l).cloned().collect());
        assert_eq!(got, Err(PageFault::TooManyPages { max: 5 }));
        // Exactly at the cap: the last page is short, the list is whole.
        let all = rows(45);
        let got = walk(10, 5, |o, l| all.iter().skip(o).take(l).cloned().collect());
        assert_eq!(got.unwrap(), all);
    }

    /// Reads `rows(n)` from a server that serves at most `cap` rows a page: the rows read,
    /// and how many pages.
    fn capped(n: usize, size: usize, cap: usize) -> (Result<Vec<String>, PageFault>, usize) {
        let all = rows(n);
        let mut served = 0;
        let got = walk(size, 1000, |o, l| {
            served += 1;
            all.iter().skip(o).take(l.min(cap)).cloned().collect()
        });
        (got, served)
    }

    #[test]
    fn a_server_capping_pages_below_the_size_asked_is_read_whole() {
        for n in [0, 1, 99, 100, 499, 500, 501, 998, 999, 1000, 1499, 2500] {
            let (got, served) = capped(n, 1000, 500);
            assert_eq!(got.unwrap(), rows(n), "{n} rows");
            // One page per 499 new rows after the first 500, and one more read where a
            // page of 500 could be the last.
            assert!(served <= 2 + n / 499, "{n} rows: {served} pages");
        }
        // A cap at merod's default page, as when `limit` is ignored.
        for n in [100, 101, 250, 1000] {
            let (got, _) = capped(n, 1000, PAGE_FLOOR);
            assert_eq!(got.unwrap(), rows(n), "{n} rows");
        }
    }

    #[test]
    fn only_a_short_page_that_could_be_a_cap_costs_a_read_more() {
        // Under merod's default page: the last, no read more.
        for n in [0, 1, 3, 99] {
            assert_eq!(capped(n, 1000, 1000).1, 1, "{n} rows");
        }
        // 100 rows or more, fewer than asked: one read more, which finds only the anchor.
        for n in [100, 150, 999] {
            let (got, served) = capped(n, 1000, 1000);
            assert_eq!(got.unwrap(), rows(n));
            assert_eq!(served, 2, "{n} rows");
        }
        // Once merod's cap is learned, a page under it ends the list at once.
        let (got, served) = capped(1200, 1000, 500);
        assert_eq!(got.unwrap(), rows(1200));
        assert_eq!(served, 3, "500, 499 new, 201 new");
        // After a full page, merod puts no cap below the size asked: no read more.
        let (got, served) = capped(2500, 1000, 1000);
        assert_eq!(got.unwrap(), rows(2500));
        assert_eq!(served, 3, "1000, 999 new, 501 new");
    }

    #[test]
    fn a_read_past_a_short_page_that_does_not_continue_it_is_an_error() {
        // The list shifted between the short page and the read past it.
        let mut all = rows(300);
        let mut pages = 0;
        let got = walk(1000, 100, |o, l| {
            pages += 1;
            if pages == 2 {
                all.remove(0);
            }
            all.iter().skip(o).take(l.min(200)).cloned().collect()
        });
        assert_eq!(got, Err(PageFault::Shifted { offset: 199 }));
        // A server ignoring `offset` and capping: the read past repeats the first page.
        let all = rows(300);
        let got = walk(1000, 100, |_, l| {
            all.iter().take(l.min(200)).cloned().collect()
        });
        assert_eq!(got, Err(PageFault::NotAdvancing { offset: 199 }));
    }
}
