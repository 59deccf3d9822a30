//! RFC 3339 times, as a key's `expires_at` is written.
//!
//! Hand-written rather than the `time` crate's parser (which builds for wasm32-wasip1, and is
//! already in the workspace for the CLI): that one is stricter — a day past its month's end,
//! a leap second away from 23:59:60 UTC, seconds written with a sign or an exponent — so it would
//! refuse configs that load today.

/// An RFC 3339 time (`2027-01-31T00:00:00Z`, fractions and `±HH:MM` offsets allowed) in ms
/// since the Unix epoch. Years and offsets are bounded as RFC 3339 bounds them (four digits,
/// under a day), which also keeps the arithmetic from overflowing on a hostile config.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let (date, time) = text.split_once(['T', 't'])?;
    let mut d = date.split('-');
    let (y, m, day): (i64, i64, i64) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    if d.next().is_some()
        || !(0..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
    {
        return None;
    }
    let (clock, offset_s) = if let Some(clock) = time.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (clock, offset) = time.split_at(at);
        let (sign, hm) = offset.split_at(1);
        let (oh, om) = hm.split_once(':')?;
        let (oh, om): (i64, i64) = (oh.parse().ok()?, om.parse().ok()?);
        if !(0..=23).contains(&oh) || !(0..=59).contains(&om) {
            return None;
        }
        let seconds = oh * 3600 + om * 60;
        (clock, if sign == "-" { -seconds } else { seconds })
    };
    let mut c = clock.split(':');
    let (h, min): (i64, i64) = (c.next()?.parse().ok()?, c.next()?.parse().ok()?);
    let seconds: f64 = c.next()?.parse().ok()?;
    if c.next().is_some()
        || !(0..=23).contains(&h)
        || !(0..=59).contains(&min)
        || !(0.0..61.0).contains(&seconds)
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let ms = (days * 86_400 + h * 3_600 + min * 60 - offset_s) * 1_000 + (seconds * 1_000.0) as i64;
    u64::try_from(ms).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_are_read_with_their_offsets() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2000-02-29T12:30:00.5Z"),
            Some(951_827_400_500)
        );
        assert_eq!(
            parse_rfc3339("2000-02-29T14:30:00+02:00"),
            parse_rfc3339("2000-02-29T12:30:00Z")
        );
        for bad in [
            "2000-13-01T00:00:00Z",
            "2000-01-01",
            "2000-01-01T25:00:00Z",
            "x",
            // Past what RFC 3339 spells, and past what the arithmetic holds.
            "99999999999999999-01-01T00:00:00Z",
            "2000-01-01T00:00:00+99999999999999:00",
            "2000-01-01T00:00:00-00:99999999999999",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
