//! The node's TEE role per confirmed namespace, as last confirmed to MDMA: after each held
//! refresh a few confirmed namespaces (round robin) have their role read again, and one
//! whose role differs from the one MDMA was told is confirmed again with the new role.
//! Kept in memory: after a restart each confirmed namespace is confirmed once more, with
//! its role, when its turn comes.

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::GroupId;
use crate::merod::TeeRole;

/// Confirmed namespaces whose role is read again after each held refresh.
pub(crate) const ROLE_CHECKS_PER_ROUND: usize = 8;

/// The roles MDMA was told and where the round robin stands.
#[derive(Debug, Default)]
pub(crate) struct Roles {
    /// The role sent in the latest successful confirm of each namespace.
    pub(crate) confirmed: BTreeMap<GroupId, Option<TeeRole>>,
    /// The last namespace checked (the next round starts after it).
    cursor: Option<GroupId>,
}

impl Roles {
    /// Records a successful confirm of `id` with `role`.
    pub(crate) fn confirmed_with(&mut self, id: GroupId, role: Option<TeeRole>) {
        self.confirmed.insert(id, role);
    }

    /// The role MDMA was last told for `id` (`None`: not confirmed by this process yet).
    pub(crate) fn told(&self, id: GroupId) -> Option<Option<TeeRole>> {
        self.confirmed.get(&id).copied()
    }

    /// The next round of checks among `candidates` (skipping `busy`), and forgets roles of
    /// namespaces no longer confirmed.
    pub(crate) fn next_round(
        &mut self,
        candidates: &BTreeSet<GroupId>,
        busy: impl Fn(&GroupId) -> bool,
    ) -> Vec<GroupId> {
        self.confirmed.retain(|id, _| candidates.contains(id));
        let round = next_round(candidates, self.cursor, ROLE_CHECKS_PER_ROUND, busy);
        if let Some(last) = round.last() {
            self.cursor = Some(*last);
        }
        round
    }
}

/// Up to `n` ids of `candidates` after `after` in id order, wrapping around, each at most
/// once, leaving out the `busy` ones.
pub(crate) fn next_round(
    candidates: &BTreeSet<GroupId>,
    after: Option<GroupId>,
    n: usize,
    busy: impl Fn(&GroupId) -> bool,
) -> Vec<GroupId> {
    use std::ops::Bound::{Excluded, Unbounded};
    let tail = candidates.range((after.map_or(Unbounded, Excluded), Unbounded));
    let head = candidates
        .iter()
        .take_while(|id| after.is_some_and(|a| **id <= a));
    tail.chain(head)
        .filter(|id| !busy(id))
        .take(n)
        .copied()
        .collect()
}

/// Whether a confirm must be sent again: the role read differs from the one MDMA was told
/// (or MDMA was not told one by this process).
pub(crate) fn needs_confirm(told: Option<Option<TeeRole>>, read: Option<TeeRole>) -> bool {
    told != Some(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ids::test_id as id;

    #[test]
    fn rounds_go_round_robin_and_skip_busy_ones() {
        let all: BTreeSet<GroupId> = (1..=5).map(id).collect();
        assert_eq!(next_round(&all, None, 2, |_| false), [id(1), id(2)]);
        assert_eq!(next_round(&all, Some(id(2)), 2, |_| false), [id(3), id(4)]);
        assert_eq!(
            next_round(&all, Some(id(4)), 3, |_| false),
            [id(5), id(1), id(2)]
        );
        assert_eq!(
            next_round(&all, Some(id(4)), 9, |_| false).len(),
            5,
            "each once"
        );
        assert_eq!(next_round(&all, None, 2, |i| *i == id(1)), [id(2), id(3)]);
        assert!(next_round(&BTreeSet::new(), Some(id(3)), 2, |_| false).is_empty());
    }

    #[test]
    fn the_cursor_moves_and_roles_of_unconfirmed_namespaces_are_forgotten() {
        let mut r = Roles::default();
        r.confirmed_with(id(9), Some(TeeRole::RelayTee));
        let all: BTreeSet<GroupId> = (1..=10).map(id).collect();
        assert_eq!(r.next_round(&all, |_| false).len(), ROLE_CHECKS_PER_ROUND);
        assert_eq!(r.next_round(&all, |_| false)[0], id(9));
        let fewer: BTreeSet<GroupId> = [id(1)].into();
        r.next_round(&fewer, |_| false);
        assert_eq!(r.told(id(9)), None);
    }

    #[test]
    fn a_confirm_is_sent_again_only_when_the_role_changed_or_was_never_told() {
        let relay = Some(TeeRole::RelayTee);
        assert!(!needs_confirm(Some(relay), relay));
        assert!(!needs_confirm(Some(None), None));
        assert!(needs_confirm(Some(None), relay));
        assert!(needs_confirm(Some(relay), Some(TeeRole::ReadOnlyTee)));
        assert!(needs_confirm(Some(relay), None));
        assert!(needs_confirm(None, None), "not told by this process");
    }
}
