//! Reading one of merod's offset-paged lists whole, or not at all. Offset paging can lie
//! in two ways: a server that ignores `offset` answers the first page for ever (a loop that
//! ends only on a short page never ends), and a row removed before the offset between two
//! page reads shifts the rest, so a row held throughout is skipped and the list looks whole.
//! Pages therefore overlap by one row (the anchor): each page after the first must start with
//! the previous page's last row, must add at least one row, and there are at most so many
//! pages. Every paged read of merod goes through [`PageWalk`].

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

/// One walk through an offset-paged list of `size` rows a page, at most `max_pages` pages
/// (see the module docs).
#[derive(Debug)]
pub(crate) struct PageWalk {
    size: usize,
    max_pages: usize,
    pages: usize,
    offset: usize,
    /// The previous page's first and last row.
    previous: Option<(String, String)>,
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
        if keys.len() < self.size {
            return Ok(Step::Done);
        }
        if let (Some(first), Some(last)) = (keys.first(), keys.last()) {
            self.previous = Some(((*first).to_owned(), (*last).to_owned()));
        }
        self.offset += self.size - 1;
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
}
