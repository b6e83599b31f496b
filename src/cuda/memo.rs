//! A bounded memo of a pure function's results, for host work an op repeats on every call
//! with the same inputs: a TMA descriptor depends only on the pointer, the shape, the strides
//! and the box, and encoding one per tensor per call (up to 2·MK_MAX_PEERS + 1 of them for
//! ring attention) is host time that fusion exists to remove.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::Hash;

/// Results of `f(key)` by key, handed out by clone (an `Arc` for a large value: the clone
/// is made under the lock). When `capacity` entries are held, the next miss empties the
/// memo first: simple, and a program that keeps reusing its buffers refills it at once.
pub struct Memo<K, V> {
    map: Mutex<Option<HashMap<K, V>>>,
    capacity: usize,
}

impl<K: Hash + Eq, V: Clone> Memo<K, V> {
    pub const fn new(capacity: usize) -> Self {
        Memo { map: Mutex::new(None), capacity }
    }

    /// `f(&key)`'s value: remembered, or computed now (outside the lock) and remembered
    /// when it succeeds; an error is returned and not remembered.
    pub fn get_or_try<E>(&self, key: K, f: impl FnOnce(&K) -> Result<V, E>) -> Result<V, E> {
        if let Some(v) = self.map.lock().as_ref().and_then(|m| m.get(&key)) {
            return Ok(v.clone());
        }
        let v = f(&key)?;
        let mut guard = self.map.lock();
        let map = guard.get_or_insert_with(HashMap::new);
        if map.len() >= self.capacity {
            map.clear();
        }
        map.insert(key, v.clone());
        Ok(v)
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.map.lock().as_ref().map_or(0, HashMap::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_key_is_computed_once_errors_are_not_kept_and_the_size_is_bounded() {
        let memo: Memo<u64, u64> = Memo::new(3);
        let calls = Cell::new(0);
        let square = |k: &u64| -> Result<u64, String> {
            calls.set(calls.get() + 1);
            Ok(k * k)
        };
        assert_eq!(memo.get_or_try(4, square), Ok(16));
        assert_eq!(memo.get_or_try(4, square), Ok(16));
        assert_eq!(calls.get(), 1, "the second call is remembered");
        assert_eq!(memo.get_or_try(5, |_| Err::<u64, _>("refused".to_string())), Err("refused".to_string()));
        assert_eq!(memo.len(), 1, "a failure is not remembered");
        assert_eq!(memo.get_or_try(5, square), Ok(25));
        assert_eq!(memo.get_or_try(6, square), Ok(36));
        assert_eq!(memo.len(), 3);
        assert_eq!(memo.get_or_try(7, square), Ok(49));
        assert_eq!(memo.len(), 1, "a full memo is emptied before the next entry");
        assert_eq!(memo.get_or_try(4, square), Ok(16));
        assert_eq!(calls.get(), 5, "4 is computed again after the memo was emptied");
    }
}
